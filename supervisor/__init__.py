"""The everystep supervisor: runs the engine's workers in production."""
