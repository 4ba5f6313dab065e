"""Repository tooling (docs generation and checks); not part of the accel_ddp package."""
