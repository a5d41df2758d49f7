"""`tandem up`: the local cluster launcher (process supervision, readiness, demo)."""

import sys


def up(argv: list[str]) -> int:
    """`tandem up` runs the tiers as local processes; with `--ray [ADDRESS]`, as Ray actors.
    Both launchers read the same plan (plan.py) and never import each other."""
    if any(a == "--ray" or a.startswith("--ray=") for a in argv):
        from tandem.launch.plan import local_only_in

        if local := local_only_in(argv):  # never accepted and ignored
            print(f"tandem up --ray: {', '.join(local)}: only for the local launcher (its "
                  "port plan and restarts); Ray places the actors", file=sys.stderr)
            return 2
        from tandem.launch.ray_up import main as launch
    else:
        from tandem.launch.up import main as launch

    return launch(argv) or 0
