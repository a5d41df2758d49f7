"""`tandem serve MODEL [vLLM's flags]`: `vllm serve`'s command line, run as `tandem up`.

A vLLM user keeps their command. Every vLLM flag has one fate, written in the table of
tandem/launch/vllm_flags.py (`tandem serve --help` prints it, docs/serve.md shows it):
mapped onto the Tandem flag that honours it, accepted with one notice line where it changes
nothing here, or refused with the reason. `tandem up`'s own flags pass through as they are.
The result is exactly the `tandem up` command that `--dry-run` prints, and it is checked
here, every tier's settings parsed, before anything starts: a bad value (`--dtype half3`)
ends `--dry-run` as it would end the launch.

Invariants: a flag is never dropped without a word (mapped, a notice, or an error); one
`tandem up` flag set twice to different values (`--uvicorn-log-level info` with
`--disable-log-requests`) is an error naming both; the caller's own --encoder-args/
--language-args/--router-args come after the mapped flags, so they win.
"""

from __future__ import annotations

import re
import shlex
import sys
import textwrap
from dataclasses import dataclass, field

from tandem.launch.vllm_flags import (
    BY_NAME,
    Arity,
    Fate,
    Flag,
    Refused,
    To,
    dotted_json,
    help_table,
)

# The router's default ports (plan.py); vLLM's --port moves the gRPC port by this offset
# so two `tandem serve --port` on one host never meet on 50051.
DEFAULT_HTTP_PORT, DEFAULT_GRPC_PORT = 8000, 50051
_LOWEST_PORT = 1024  # where a moved gRPC port wraps to past 65535
_TIER_ARGS = {"--encoder-args": To.ENCODER, "--language-args": To.LANGUAGE,
              "--router-args": To.ROUTER}


def grpc_port_for(http_port: int) -> int:
    """The router's gRPC port for vLLM's `--port P`: P + 42051 (8000 -> 50051, the
    defaults), wrapped past 65535 to 1024 and up. Distinct HTTP ports from 1024 up get
    distinct gRPC ports."""
    port = http_port + DEFAULT_GRPC_PORT - DEFAULT_HTTP_PORT
    span = 65536 - _LOWEST_PORT
    return port if port <= 65535 else _LOWEST_PORT + (port - _LOWEST_PORT) % span


class ServeError(ValueError):
    """A command line that cannot be served as asked; each line says what and why."""


@dataclass(frozen=True)
class Setting:
    """A `tandem up` flag's value (None: a switch) and the flag that set it."""

    value: str | None
    source: str


@dataclass
class Launch:
    """A `tandem serve` command line, translated flag by flag."""

    model: str
    up: dict[str, Setting] = field(default_factory=dict)  # `tandem up` flag -> its setting
    passthrough: list[str] = field(default_factory=list)  # under --ray: ray_up.py's own flags
    tier: dict[To, list[str]] = field(default_factory=lambda: {t: [] for t in _TIER_ARGS.values()})
    own: dict[To, list[str]] = field(default_factory=lambda: {t: [] for t in _TIER_ARGS.values()})
    notices: list[str] = field(default_factory=list)

    def set_up_flag(self, flag: str, value: str | None, source: str) -> None:
        """A `tandem up` flag; a second setting with another value is refused (it would
        silently override the first)."""
        was = self.up.get(flag)
        if was is not None and was.value != value:
            raise ServeError(f"{source} sets {flag} {value or ''}, but {was.source} already "
                             f"set it to {was.value}: give one of them")
        self.up.setdefault(flag, Setting(value, source))

    def argv(self) -> list[str]:
        """The `tandem up` arguments."""
        out = ["--model", self.model]
        for flag, s in self.up.items():
            out += [flag] if s.value is None else [flag, s.value]
        out += self.passthrough
        for arg, t in _TIER_ARGS.items():
            if self.tier[t] or self.own[t]:  # the caller's own tier flags after the mapped
                out.append(f"{arg}={shlex.join(self.tier[t] + self.own[t])}")
        return out


def _up_actions() -> dict[str, int | str | None]:
    """`tandem up`'s own option strings -> their nargs (0: a switch)."""
    from tandem.launch.plan import parser

    return {s: a.nargs for a in parser()._actions for s in a.option_strings}


def _split(token: str) -> tuple[str, str, str | None]:
    """A token -> (vLLM flag name, dotted key, inline value): `--max_model_len=4k` ->
    ("--max-model-len", "", "4k"); `--limit-mm-per-prompt.image` -> (..., "image", None);
    `-O3` -> ("-O", "", "3"). vLLM takes `_` for `-` in a name (not in a dotted key)."""
    if re.fullmatch(r"-O\d", token):
        return "-O", "", token[2:]
    name, eq, inline = token.partition("=")
    head, _, key = name.partition(".")
    if head.startswith("--"):
        head = "--" + head[2:].replace("_", "-")
    return head, key, inline if eq else None


def _values(row: Flag, name: str, inline: str | None, rest: list[str]) -> tuple[str, ...]:
    """The values `row` takes, from `=value` or the next tokens (taken out of `rest`)."""
    if row.arity is Arity.SWITCH:
        if inline is not None:
            raise ServeError(f"{name} takes no value")
        return ()
    if inline is not None:
        return (inline,)
    if not rest or (row.arity is Arity.SEVERAL and rest[0].startswith("-")):
        raise ServeError(f"{name} needs a value")
    values = [rest.pop(0)]
    while row.arity is Arity.SEVERAL and rest and not rest[0].startswith("-"):
        values.append(rest.pop(0))
    return tuple(values)


def _apply(launch: Launch, row: Flag, name: str, values: tuple[str, ...], shown: str) -> None:
    """One vLLM flag's fate, carried out on `launch` (`shown`: the flag as it was given)."""
    if row.fate is Fate.REFUSED:
        raise ServeError(f"{shown} (vLLM) is refused: {row.text}")
    try:
        effect = row.apply(values) if row.apply else None
    except Refused as e:
        raise ServeError(f"{shown} (vLLM) is refused: {e}") from None
    if row.fate is Fate.ACCEPTED:  # changes nothing: its apply only checks the values
        assert effect is None or not effect.puts, row.names
        launch.notices.append(f"{shown} (vLLM) accepted: {row.text}")
    if effect is None:
        return
    if effect.notice:
        launch.notices.append(f"{shown} (vLLM): {effect.notice}")
    for put in effect.puts:
        if put.to is To.UP:
            flag, *value = put.flags
            launch.set_up_flag(flag, value[0] if value else None, name)
        else:
            launch.tier[put.to] += put.flags


def _model(argv: list[str]) -> tuple[str, list[str]]:
    """(the model, the other arguments): `tandem serve MODEL ...`, or vLLM's older
    `--model MODEL` anywhere."""
    if argv and not argv[0].startswith("-"):
        return argv[0], list(argv[1:])
    for i, a in enumerate(argv):
        if a == "--model" and i + 1 < len(argv):
            return argv[i + 1], argv[:i] + argv[i + 2:]
        if a.startswith("--model="):
            return a.split("=", 1)[1], argv[:i] + argv[i + 1:]
    raise ServeError("the model comes first: tandem serve MODEL [flags]")


def translate_launch(argv: list[str]) -> Launch:
    """`tandem serve` arguments -> the Launch they ask for. Every problem is collected, so
    one ServeError lists them all (a pasted command line is fixed in one go)."""
    model, rest = _model(argv)
    launch = Launch(model)
    up_flags = _up_actions()
    ray = any(a == "--ray" or a.startswith("--ray=") for a in rest)  # ray_up.py judges its own
    errors: list[str] = []
    while rest:
        token = rest.pop(0)
        try:
            _step(launch, token, rest, up_flags, ray)
        except ServeError as e:
            errors.append(str(e))
    http = launch.up.get("--http-port")
    if http is not None and http.source == "--port" and "--grpc-port" not in launch.up:
        launch.set_up_flag("--grpc-port", str(grpc_port_for(int(http.value or 0))), "--port")
    if errors:
        raise ServeError("\n".join(errors))
    return launch


def _step(launch: Launch, token: str, rest: list[str], up_flags: dict[str, int | str | None],
          ray: bool) -> None:
    """One token (and the values it takes out of `rest`) onto `launch`."""
    name, key, inline = _split(token)
    if name in BY_NAME:
        row = BY_NAME[name]
        if key and not row.dotted:
            raise ServeError(f"{name} takes no .key form ({token})")
        values = _values(row, token.partition("=")[0], inline, rest)
        shown = shlex.join([token, *(values if inline is None else ())])
        if key:  # `--flag.a.b v`: vLLM's `--flag '{"a": {"b": v}}'`
            values = (dotted_json(key, values[0]),)
        _apply(launch, row, name, values, shown)
    elif name in _TIER_ARGS:
        if inline is None and not rest:
            raise ServeError(f"{name} needs a value")
        launch.own[_TIER_ARGS[name]] = shlex.split(inline if inline is not None else rest.pop(0))
    elif token.partition("=")[0] in up_flags:
        flag = token.partition("=")[0]
        if flag == "--model":
            raise ServeError("the model is given once: tandem serve MODEL [flags]")
        if up_flags[flag] == 0:
            launch.set_up_flag(flag, None, flag)
        elif inline is None and not rest:
            raise ServeError(f"{flag} needs a value")
        else:
            launch.set_up_flag(flag, inline if inline is not None else rest.pop(0), flag)
    elif ray:
        launch.passthrough.append(token)
    elif token.startswith("-"):
        raise ServeError(f"{name} is neither a vLLM flag `tandem serve` knows nor a `tandem up` "
                         "flag: `tandem serve --help` lists the vLLM flags, `tandem up --help` "
                         "the rest; a tier's own flag goes through --encoder-args/"
                         "--language-args/--router-args")
    else:
        raise ServeError(f"{token!r}: a value with no flag before it")


def translate(argv: list[str]) -> list[str]:
    """`tandem serve` arguments -> `tandem up` arguments (ServeError on a refused flag)."""
    return translate_launch(argv).argv()


def check(launch: Launch) -> None:
    """Parse what `launch` gives `tandem up` and each tier, as they will at start: a bad
    value ends here (SystemExit 2, the tier's own message), before anything starts."""
    from tandem.config import parse_settings
    from tandem.launch.plan import local_only_in, parse_args
    from tandem.tiers import TIERS

    if not launch.passthrough:  # under --ray, ray_up.py takes its own flags out first
        parse_args(launch.argv())
    elif local := local_only_in(launch.argv()):  # what `tandem up --ray` refuses
        print(f"tandem serve: {', '.join(local)}: only for the local launcher, not under "
              "--ray", file=sys.stderr)
        raise SystemExit(2)
    for t in (To.ENCODER, To.LANGUAGE, To.ROUTER):
        parse_settings(TIERS[t.value].config(),
                       ["--model", launch.model, *launch.tier[t], *launch.own[t]],
                       f"tandem serve ({t.value})")


def usage() -> str:
    tail = ("Any other vLLM flag is refused. Any `tandem up` flag passes through as it is "
            "(`tandem up --help`); --encoders N and --languages N split the tiers. --dry-run "
            "prints the `tandem up` command instead of running it (the notices go to stderr).")
    return ("usage: tandem serve MODEL [vLLM flags] [tandem up flags] [--dry-run]\n\n"
            "`vllm serve`'s command line, run as `tandem up`. Each vLLM flag's fate:\n\n"
            + help_table() + "\n\n" + textwrap.fill(tail, 100))


def main(argv: list[str]) -> int:
    if not argv or "-h" in argv or "--help" in argv:
        print(usage())
        return 0 if argv else 2
    dry = "--dry-run" in argv
    try:
        launch = translate_launch([a for a in argv if a != "--dry-run"])
    except ServeError as e:
        for line in str(e).splitlines():
            print(f"tandem serve: {line}", file=sys.stderr)
        return 2
    for line in launch.notices:
        print(f"tandem serve: {line}", file=sys.stderr)
    try:
        check(launch)
    except SystemExit as e:  # the parser printed why
        return e.code if isinstance(e.code, int) else 2
    if dry:
        print(shlex.join(["tandem", "up", *launch.argv()]))
        return 0
    from tandem.launch import up as launch_up

    return launch_up(launch.argv())


def parse(argv: list[str]):
    """The `tandem up` arguments `tandem serve argv` runs with (for tests and --dry-run)."""
    from tandem.launch.plan import parse_args

    return parse_args(translate(argv))


