"""Layer: the engine <-> rules contract (request/result types) and the one child spawner."""
