"""What carries a plan out: worker processes on this host (``local``), the services of a Compose
project (``compose``), Deployments on Kubernetes (``kubernetes``). Each says which replicas it
runs, starts one following ``latest`` or held at a version, and retires one (it drains)."""
