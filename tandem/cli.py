"""The `tandem` command: one entry point, a subcommand per process kind.

Heavy imports (torch, transformers, the services) happen inside the subcommand, so
`tandem --help` and the SDK stay light.
"""

from __future__ import annotations

import argparse
import sys

from tandem.tiers import TIERS


def _run_service(name: str, argv: list[str]) -> int:
    from tandem.config import parse_settings

    tier = TIERS[name]
    return tier.serve(parse_settings(tier.config(), argv, f"tandem {name}"))


def _tiny_model(argv: list[str]) -> int:
    from tandem.models.checkpoint import ARCHS
    from tandem.models.tiny import ALL_SIZES, REAL_SIZES

    real = ", ".join(f"{s} ({a})" for s, a in REAL_SIZES.items())
    p = argparse.ArgumentParser(
        prog="tandem tiny-model",
        description="Write a random-weight Hugging Face checkpoint (config, safetensors, "
        "tokenizer, processor, chat template) for tests and benchmarks. tiny and small: "
        f"float32, any arch. Real sizes, a released model's shapes in bfloat16: {real}; "
        "their weights are streamed to disk tensor by tensor (about one 64 MB block in "
        "memory), ~16 GB for 7b and 8b, ~62 GB for 30b-a3b.",
    )
    p.add_argument("dir", help="Output directory (created).")
    p.add_argument("--arch", choices=list(ARCHS), default=None,
                   help="Default: qwen2_5_vl, or the real size's own (another is refused).")
    p.add_argument("--size", choices=list(ALL_SIZES), default="tiny")
    p.add_argument("--seed", type=int, default=0, help="Same seed, identical weight files.")
    p.add_argument("--dry-run", action="store_true",
                   help="Write every file but the weight shards (the index names them) and "
                   "list each tensor's name, shape and file.")
    p.add_argument("--device", default="cpu",
                   help="Where a streamed build (real sizes) generates its random values; "
                   "cuda is much faster than the CPU. Values differ per kind of device.")
    args = p.parse_args(argv)
    from tandem.models.tiny import build_tiny_model, plan_tiny_model, resolve_arch

    try:
        resolve_arch(args.arch, args.size)
    except ValueError as e:
        p.error(str(e))
    path = build_tiny_model(args.dir, arch=args.arch, size=args.size, seed=args.seed,
                            dry_run=args.dry_run, device=args.device)
    if args.dry_run:
        plan = plan_tiny_model(args.arch, args.size)
        file_of = {n: f for f, names in plan.shards.items() for n in names}
        for t in plan.tensors:
            print(f"{t.name}\t{list(t.shape)}\t{t.init.value}\t{file_of[t.name]}")
        print(f"{len(plan.tensors)} tensors, {plan.num_parameters:,} parameters, "
              f"{plan.total_bytes / 1e9:.2f} GB in {str(plan.dtype).removeprefix('torch.')}, "
              f"{len(plan.shards)} shards (not written)")
    print(path)
    return 0


def _certs_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tandem certs",
        description="Write a new CA and a certificate + key per role (router, encoder, "
        "language, operator) for mTLS between the tiers: pass a tier its role's files with "
        "--internal-tls.ca/.cert/.key (docs/deploy.md, 'Internal TLS'). ca.key only signs "
        "more certificates later: keep it out of the cluster. With --kube-namespace instead "
        "of DIR (what the Helm chart's hook Job runs): create, through the Kubernetes API as "
        "the pod's ServiceAccount, each role Secret that is missing (ca.crt, tls.crt, "
        "tls.key), signed by the CA in --kube-ca-secret (created first if absent); existing "
        "Secrets are never changed.")
    p.add_argument("dir", nargs="?", help="Output directory (created; existing files are "
                   "replaced). Not with --kube-namespace.")
    p.add_argument("--days", type=int, default=365, help="Validity of every certificate.")
    p.add_argument("--kube-namespace", metavar="NS",
                   help="Create the Secrets in this namespace instead of writing files.")
    p.add_argument("--kube-ca-secret", metavar="NAME",
                   help="The CA's Secret (tls.crt, tls.key): read, or created if absent.")
    p.add_argument("--kube-secret", metavar="ROLE=NAME", action="append", default=[],
                   help="A role's Secret to create if missing (repeat per role).")
    p.add_argument("--kube-label", metavar="KEY=VALUE", action="append", default=[],
                   help="A label on every Secret created (repeat).")
    return p


def _pairs(p: argparse.ArgumentParser, flag: str, items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not (sep and key and value) or key in out:
            p.error(f"{flag} {item!r}: want KEY=VALUE, each KEY once")
        out[key] = value
    return out


def _certs_spec(argv: list[str]) -> tuple[argparse.Namespace, dict[str, str], dict[str, str]]:
    """(args, {role: Secret name}, {label: value}); a flag that does not fit the mode given
    (DIR, or --kube-namespace) is refused rather than ignored."""
    from tandem.pki import ROLES

    p = _certs_parser()
    args = p.parse_args(argv)
    if args.days < 1:
        p.error("--days must be at least 1")
    kube_flags = bool(args.kube_ca_secret or args.kube_secret or args.kube_label)
    if args.kube_namespace is None:
        if args.dir is None or kube_flags:
            p.error("give DIR, or --kube-namespace with --kube-ca-secret and --kube-secret")
        return args, {}, {}
    if args.dir is not None:
        p.error("DIR and --kube-namespace are exclusive")
    if not (args.kube_ca_secret and args.kube_secret):
        p.error("--kube-namespace needs --kube-ca-secret and at least one --kube-secret")
    secrets = _pairs(p, "--kube-secret", args.kube_secret)
    if unknown := set(secrets) - set(ROLES):
        p.error(f"--kube-secret: unknown role(s) {sorted(unknown)}; roles: {', '.join(ROLES)}")
    if args.kube_ca_secret in secrets.values() or len(set(secrets.values())) < len(secrets):
        p.error("--kube-ca-secret and each --kube-secret must name different Secrets")
    return args, secrets, _pairs(p, "--kube-label", args.kube_label)


def _certs(argv: list[str]) -> int:
    from pathlib import Path

    from tandem.pki import ROLES, KubeAPI, KubeSecretsError, ensure_kube_secrets, make_pki

    args, secrets, labels = _certs_spec(argv)
    if args.kube_namespace is not None:
        try:
            made = ensure_kube_secrets(KubeAPI(args.kube_namespace), args.kube_ca_secret,
                                       secrets, labels, args.days)
        except KubeSecretsError as e:
            print(f"tandem certs: {e}", file=sys.stderr)
            return 1
        print(f"created Secrets: {', '.join(made)}" if made else
              f"every role's Secret exists ({', '.join(secrets.values())}): nothing created")
        return 0
    paths = make_pki(Path(args.dir), days=args.days)
    print(f"{paths.ca}  (CA)")
    for role in ROLES:
        print(f"{paths.cert(role)}  {paths.key(role)}  ({role})")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "encoder": "run the encode tier (ViT) service",
        "language": "run the prefill/decode service",
        "router": "run the router (OpenAI HTTP + gRPC)",
        "up": "run a whole local cluster (encoders, language instances, router)",
        "serve": "`vllm serve`'s command line (MODEL and its flags), run as `tandem up`",
        "tiny-model": "write a random-weight checkpoint (tiny, small; real sizes 7b, 8b, 30b-a3b)",
        "certs": "write a CA and per-tier certificates for mTLS between the tiers",
    }
    if argv and argv[0] in ("-V", "--version"):
        import tandem

        print(f"tandem {tandem.version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: tandem {" + ",".join(commands) + "} [options]\n")
        for name, text in commands.items():
            print(f"  {name:<11} {text}")
        print("\n`tandem COMMAND --help` lists the command's options; `tandem --version`.")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        return _dispatch(argv[0], argv[1:])
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in ("tandem", "services"):
            raise
        # a client-only install (`pip install .` of a checkout): one line, not a traceback.
        # NOTE: no package index has tandem-vlm yet: the servers install from a checkout
        print(f"tandem {argv[0]}: needs the server install (missing {e.name}): `make setup` "
              f"in a Tandem checkout, or there `pip install '.[server]'` after torch's CPU "
              f"build", file=sys.stderr)
        return 2


# The tiers that load Mooncake, whose glog lines go through the launcher's filter.
NATIVE_LOGGING = ("encoder", "language")


def _logging_flag(argv: list[str], name: str, default: str) -> str:
    """The value a tier's argv (or its TANDEM_<NAME> variable) gives its --<name> flag, for
    the log filter around it; the tier itself judges the value."""
    import os

    flag = "--" + name.replace("_", "-")
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return os.environ.get(f"TANDEM_{name.upper()}", default)


def _dispatch(cmd: str, rest: list[str]) -> int:
    if cmd in NATIVE_LOGGING and not {"-h", "--help"} & set(rest):
        import os

        from tandem.launch.procs import FILTERED_ENV, filtered

        if os.environ.get(FILTERED_ENV) != "1":  # on its own (a pod): filter its stderr
            return filtered([sys.executable, "-m", "tandem.cli", cmd, *rest],
                            _logging_flag(rest, "log_level", "info"),
                            _logging_flag(rest, "log_format", "text"))
    if cmd in TIERS:
        return _run_service(cmd, rest)
    if cmd == "serve":
        from tandem.launch.serve import main as serve

        return serve(rest)
    if cmd == "tiny-model":
        return _tiny_model(rest)
    if cmd == "certs":
        return _certs(rest)
    from tandem.launch import up

    return up(rest)


if __name__ == "__main__":
    raise SystemExit(main())
