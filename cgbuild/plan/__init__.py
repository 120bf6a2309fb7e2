"""Layer: deciding what must be built (workspace, trace inputs and cache, planner, diff, query)."""
