"""`tandem up`: the local cluster launcher (process supervision, readiness, demo)."""


def up(argv: list[str]) -> int:
    """`tandem up` runs the tiers as local processes; with `--ray [ADDRESS]`, as Ray actors.
    Both launchers read the same plan (plan.py) and never import each other."""
    if any(a == "--ray" or a.startswith("--ray=") for a in argv):
        from tandem.launch.ray_up import main as launch
    else:
        from tandem.launch.up import main as launch

    return launch(argv) or 0
