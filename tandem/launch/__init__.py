"""`tandem up`: the local cluster launcher (process supervision, readiness, demo)."""
