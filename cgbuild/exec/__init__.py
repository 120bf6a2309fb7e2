"""Layer: doing what a plan approved (local mint, fleet)."""
