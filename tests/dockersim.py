"""A dry run of a Dockerfile, for the tests (there is no Docker engine here).

Each stage's RUN steps really execute, in a shell, but against a stand-in filesystem and
stand-in tools that record every call, so a test can ask what the steps *do* (which packages
apt installs, what pip installs into which venv in which order and under which constraints,
which user exists, what the entrypoint runs) instead of matching the file's text.

The model, enough for that and no more:

- Instructions: FROM (stages, global ARGs), ARG and ENV scoping with `${VAR}` substitution,
  RUN (shell and exec form), COPY (from the context or `--from=<stage>`), WORKDIR, USER,
  EXPOSE, ENTRYPOINT and CMD. A stage built FROM another starts from a copy of its
  filesystem, config and record of calls.
- Filesystem: each stage has a directory standing for its `/`. Absolute paths in a RUN step,
  and in the recipes of a `make` it runs, are moved into it before the shell sees them
  (`map_paths`), and the stand-in tools refuse to write outside it.
- Tools: an external base image has coreutils, apt-get and ldconfig (nothing is installed).
  `apt-get install` needs `apt-get update` first (lists removed by
  `rm -rf /var/lib/apt/lists/*` are gone) and adds the programs of the packages it installs
  (PACKAGE_PROGRAMS); `python3 -m venv DIR` needs python3-venv and makes DIR/bin/python and
  pip; `pip install` of a wheel needs the file and, for the tandem wheel (or the project
  directory), adds the `tandem` console script; `pip wheel` writes a wheel; `make` is GNU
  make itself, its recipes run through the same path-moving shell. `id -u` answers the
  stage's USER. Any other program is "not found", so a new tool in the Dockerfile fails
  loudly here until it gets a stand-in.
"""

from __future__ import annotations

import inspect
import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
RECORDED_ENV = ("PIP_CONSTRAINT", "PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL", "PIP_NO_DEPS")
BASE_TOOLS = {"usr/bin": ("ls", "grep", "rm", "mkdir", "touch", "chown", "chmod", "id",
                          "apt-get", "groupadd", "useradd"),
              "sbin": ("ldconfig",)}
# Debian packages that add a program (the others, libraries, are only recorded).
PACKAGE_PROGRAMS = {"python3": "python3", "make": "make", "tini": "tini", "g++": "g++",
                    "curl": "curl", "sudo": "sudo"}
FIELD, RECORD = "\0", "\x1e"


class BuildError(AssertionError):
    pass


# ---- parsing ---------------------------------------------------------------------------------


@dataclass
class Instr:
    stage: str  # "" before the first FROM
    op: str
    args: str  # after the flags
    flags: dict[str, str] = field(default_factory=dict)


def parse_dockerfile(text: str) -> list[Instr]:
    """Instructions with continuation lines joined, comments dropped, leading `--flag=x`
    words split off (FROM, COPY, ADD, RUN), each tagged with its stage's name."""
    out, stage, buf, n = [], "", "", 0
    for line in text.splitlines():
        if line.lstrip().startswith("#") or (not buf and not line.strip()):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        full = (buf + line).strip()
        buf = ""
        if not full:
            continue
        op, _, args = full.partition(" ")
        op, args, flags = op.upper(), args.strip(), {}
        if op in ("FROM", "COPY", "ADD", "RUN"):
            while m := re.match(r"--([\w-]+)(?:=(\S*))?\s+", args):
                flags[m.group(1)] = m.group(2) or ""
                args = args[m.end():]
        if op == "RUN" and re.match(r"<<-?['\"]?\w+", args):
            raise BuildError(f"RUN heredocs are not modelled: {args[:60]}")
        if op == "FROM":
            m = re.search(r"\s+AS\s+(\S+)$", args, re.I)
            stage = m.group(1).lower() if m else str(n)
            n += 1
        out.append(Instr(stage, op, args, flags))
    if buf:
        raise BuildError("Dockerfile ends inside a continuation")
    return out


def expand(s: str, env: dict[str, str | None]) -> str:
    """Dockerfile substitution: $X, ${X}, ${X:-word}, ${X:+word}."""

    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        val = env.get(name)
        if m.group(3):
            if m.group(3) == ":-":
                return val if val else m.group(4)
            return m.group(4) if val else ""
        return val or ""

    return re.sub(r"\$(?:([A-Za-z_]\w*)|\{([A-Za-z_]\w*)(?:(:[-+])([^}]*))?\})", one, s)


def exec_or_shell(args: str) -> list[str]:
    """ENTRYPOINT/CMD/RUN: the JSON (exec) form as is, the shell form under /bin/sh -c."""
    if args.startswith("["):
        argv = json.loads(args)
        assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), args
        return argv
    return ["/bin/sh", "-c", args]


def map_paths(cmd: str, root: str) -> str:
    """`cmd` (a shell command) with its absolute paths moved under `root`: a `/` that starts
    a word, an assignment's value or a redirection's target (not one inside a URL, not
    /dev or /proc, not one already under `root`)."""
    lead = r"(^|[\s\"'=(;|&<>`])"
    inside = r"(?!(?:dev|proc)/)(?!" + re.escape(root.lstrip("/")) + r"(?:/|\b))"
    cmd = re.sub(lead + r"/(?=[A-Za-z_.])" + inside, lambda m: m.group(1) + root + "/", cmd)
    return re.sub(lead + r"/(?=$|[\s\"';)|&])", lambda m: m.group(1) + root, cmd)


# ---- the stand-in tools ----------------------------------------------------------------------

SHELL_SCRIPT = """#!{python} -IS
# The shell of the simulated image (tests/dockersim.py): moves absolute paths into the
# stand-in root, then runs {{/bin/sh or /bin/bash}} -c.
import os, re, sys
{map_paths}
args = sys.argv[1:]
i = args.index("-c")
args[i + 1] = map_paths(args[i + 1], os.environ["SIM_ROOT"])
real = "/bin/bash" if sys.argv[0].endswith("bash") else "/bin/sh"
os.execv(real, [real, *args])
"""

TOOL_SCRIPT = r"""#!/bin/sh
# A stand-in tool of the simulated image (tests/dockersim.py): records the call, then acts.
me=${0##*/}
here=${0%/*}
record() {
  {
    printf '%s\0' "$SIM_STAGE" "$(pwd)" "$SIM_UID"
@ENV@
    printf '%s\0' -- "$0" "$@"
    printf '\036'
  } >>"$SIM_LOG"
}
fail() { printf 'sim: %s: %s\n' "$me" "$*" >&2; exit 1; }
inside() {
  case "$1" in *..*) return 1;; "$SIM_ROOT"|"$SIM_ROOT"/*) return 0;; /*) return 1;; esac
  case "$(pwd)" in "$SIM_ROOT"|"$SIM_ROOT"/*) return 0;; esac
  return 1
}
paths_inside() {
  for a in "$@"; do
    case "$a" in -*) ;; *) inside "$a" || fail "$a is outside the image";; esac
  done
}
link() { /bin/mkdir -p "${1%/*}" && /bin/ln -sf "$SIM_TOOL" "$1"; }
apt() {
  lists=$SIM_ROOT/var/lib/apt/lists
  sub=; pkgs=; skip=
  for a in "$@"; do
    if [ -n "$skip" ]; then skip=; continue; fi
    case "$a" in -o|-c|-t) skip=1;; -*) ;; *) if [ -z "$sub" ]; then sub=$a; else pkgs="$pkgs $a"; fi;; esac
  done
  case "$sub" in
    update) /bin/mkdir -p "$lists" && /bin/touch "$lists/index";;
    install)
      [ -e "$lists/index" ] || fail "Unable to locate package$pkgs (no package lists: apt-get update)"
      for p in $pkgs; do
        case "$p" in
@PROGRAMS@
          python3-venv) /bin/mkdir -p "$SIM_ROOT/usr/share/sim" && /bin/touch "$SIM_ROOT/usr/share/sim/python3-venv";;
        esac
      done;;
  esac
}
venv() {
  dir=; withpip=1
  for a in "$@"; do case "$a" in --without-pip) withpip=;; -*) ;; *) dir=$a;; esac; done
  [ -n "$dir" ] || fail "venv: no directory"
  inside "$dir" || fail "venv: $dir is outside the image"
  case "$0" in
    "$SIM_ROOT"/usr/bin/*) [ -e "$SIM_ROOT/usr/share/sim/python3-venv" ] \
      || fail "The virtual environment was not created: ensurepip is not available (python3-venv)";;
  esac
  link "$dir/bin/python" && link "$dir/bin/python3" || exit 1
  if [ -n "$withpip" ]; then link "$dir/bin/pip" && link "$dir/bin/pip3" || exit 1; fi
}
pip() {
  sub=; wdir=; want=
  for a in "$@"; do
    if [ -n "$want" ]; then wdir=$a; want=; continue; fi
    case "$a" in
      --wheel-dir=*) wdir=${a#*=};;
      --wheel-dir|-w) want=1;;
      -*) ;;
      *) [ -n "$sub" ] || sub=$a;;
    esac
  done
  case "$sub" in
    install)
      for a in "$@"; do
        case "$a" in
          *.whl|*.whl\[*)
            f=${a%%\[*}
            [ -f "$f" ] || fail "$f is not a wheel file"
            case "${f##*/}" in tandem_vlm-*) link "$here/tandem";; esac;;
          .|.\[*) link "$here/tandem";;
        esac
      done;;
    wheel)
      [ -n "$wdir" ] || fail "pip wheel without --wheel-dir"
      inside "$wdir" || fail "$wdir is outside the image"
      /bin/mkdir -p "$wdir" && /bin/touch "$wdir/$SIM_WHEEL";;
  esac
}
case "$me" in
  ls|grep|sleep) exec /bin/$me "$@";;
  id) case "$1" in -u|-g) echo "$SIM_UID";; *) echo "uid=$SIM_UID gid=$SIM_UID";; esac;;
  rm|mkdir|touch) record "$@"; paths_inside "$@"; exec /bin/$me "$@";;
  apt-get) record "$@"; apt "$@";;
  sudo) record "$@"; exec "$@";;
  make) record "$@"; exec /usr/bin/make SHELL="$SIM_BASH" "$@";;
  python|python3|pip|pip3)
    record "$@"
    case "$me" in pip|pip3) pip "$@"; exit;; esac
    if [ "$1" = -m ] && [ "$2" = venv ]; then shift 2; venv "$@"; fi
    if [ "$1" = -m ] && [ "$2" = pip ]; then shift 2; pip "$@"; fi;;
  chown|chmod|groupadd|useradd|ldconfig|tini|g++|curl|tandem) record "$@";;
  *) fail "not found: no stand-in for this program in tests/dockersim.py";;
esac
"""


def _write_tools(dirpath: Path) -> dict[str, str]:
    dirpath.mkdir(parents=True, exist_ok=True)
    env_lines = "\n".join(
        f'    [ -n "${{{k}+x}}" ] && printf \'{k}=%s\\0\' "${k}"' for k in RECORDED_ENV
    )
    programs = "\n".join(
        f'          {pkg}) link "$SIM_ROOT/usr/bin/{prog}";;' for pkg, prog in PACKAGE_PROGRAMS.items()
    )
    tool = dirpath / "tool"
    tool.write_text(TOOL_SCRIPT.replace("@ENV@", env_lines).replace("@PROGRAMS@", programs))
    shell = dirpath / "sh"
    shell.write_text(SHELL_SCRIPT.format(python=sys.executable,
                                         map_paths=inspect.getsource(map_paths)))
    bash = dirpath / "bash"
    shutil.copy(shell, bash)
    for f in (tool, shell, bash):
        f.chmod(0o755)
    return {"SIM_TOOL": str(tool), "SIM_SH": str(shell), "SIM_BASH": str(bash)}


# ---- what a stage is -------------------------------------------------------------------------


@dataclass
class Call:
    """One program run by a RUN step, as the image would see it (paths unmapped)."""

    stage: str
    cwd: str
    uid: int
    env: dict[str, str]  # the recorded PIP_* variables that were set
    argv: list[str]  # argv[0]: the program's path in the image

    @property
    def tool(self) -> str:
        return posixpath.basename(self.argv[0])


@dataclass
class Copy:
    from_stage: str | None  # None: the build context
    files: list[str]  # what it added, as paths in the image


@dataclass
class Image:
    name: str
    base: str  # the external image at the bottom of the stage's chain
    root: Path
    env: dict[str, str]
    user: str = "0"
    workdir: str = "/"
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None
    exposed: set[int] = field(default_factory=set)
    calls: list[Call] = field(default_factory=list)
    copies: list[Copy] = field(default_factory=list)

    def path(self, p: str) -> Path:
        return self.root / p.lstrip("/")

    def exists(self, p: str) -> bool:
        return os.path.lexists(self.path(p))

    def which(self, prog: str) -> str | None:
        """Where the image's PATH finds `prog` (an absolute path: whether it exists)."""
        if "/" in prog:
            return prog if self.exists(prog) else None
        for d in self.env.get("PATH", DEFAULT_PATH).split(":"):
            if d.startswith("/") and self.exists(posixpath.join(d, prog)):
                return posixpath.join(d, prog)
        return None

    def uid(self) -> int:
        """The numeric uid the image runs as (USER, by name via the useradd calls)."""
        name = self.user.split(":")[0]
        if name.isdigit():
            return int(name)
        if name == "root":
            return 0
        for c in self.calls:
            if c.tool == "useradd" and c.argv[-1] == name:
                return int(option(c.argv[1:], "-u", "--uid") or 1000)
        raise BuildError(f"USER {name}: no such user")


def option(args: list[str], *names: str) -> str | None:
    """The value of an option given as `-x V`, `--name V` or `--name=V` (last one wins)."""
    val = None
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                val = args[i + 1]
            elif n.startswith("--") and a.startswith(n + "="):
                val = a.split("=", 1)[1]
    return val


class Build:
    """`docker build` of one Dockerfile with one set of --build-arg values, simulated under
    `work`; stages are built once, on demand."""

    def __init__(self, dockerfile: Path, context: Path, work: Path,
                 build_args: dict[str, str] | None = None, wheel: str = "tandem_vlm-0-py3-none-any.whl"):
        self.instrs = parse_dockerfile(dockerfile.read_text())
        self.context, self.work = context, work
        self.args = dict(build_args or {})
        self.tools = _write_tools(work / ".tools")
        self.wheel = wheel
        self.globals: dict[str, str | None] = {}
        for i in self.instrs:
            if i.stage == "" and i.op == "ARG":
                name, default = _arg(i.args)
                self.globals[name] = self.args.get(name, default)
        self.stage_names = [i.stage for i in self.instrs if i.op == "FROM"]
        assert len(set(self.stage_names)) == len(self.stage_names), "duplicate stage names"
        self._built: dict[str, Image | BuildError] = {}

    def target(self, name: str | None = None) -> Image:
        """The image `docker build [--target name]` makes: the last stage by default."""
        return self.stage(name or self.stage_names[-1])

    def stage(self, name: str) -> Image:
        if name not in self._built:
            if name not in self.stage_names:
                raise BuildError(f"no stage {name!r}")
            try:
                self._built[name] = self._build(name)
            except BuildError as err:
                self._built[name] = err  # a failed stage fails every test that asks for it
        if isinstance(self._built[name], BuildError):
            raise self._built[name]
        return self._built[name]

    # -- building ---------------------------------------------------------------------------

    def _fresh(self, name: str, base: str) -> Image:
        img = Image(name, base, self.work / name, {"PATH": DEFAULT_PATH})
        for d in ("tmp", "root", "usr/local/bin", "usr/sbin", "bin"):
            img.path(d).mkdir(parents=True, exist_ok=True)
        for d, tools in BASE_TOOLS.items():
            img.path(d).mkdir(parents=True, exist_ok=True)
            for t in tools:
                img.path(f"{d}/{t}").symlink_to(self.tools["SIM_TOOL"])
        return img

    def _build(self, name: str) -> Image:
        instrs = [i for i in self.instrs if i.stage == name]
        frm = instrs[0]
        ref = expand(re.sub(r"\s+AS\s+\S+$", "", frm.args, flags=re.I), self.globals)
        if ref.lower() in self.stage_names:
            parent = self.stage(ref.lower())
            img = Image(name, parent.base, self.work / name, dict(parent.env), parent.user,
                        parent.workdir, parent.entrypoint, parent.cmd, set(parent.exposed),
                        list(parent.calls), list(parent.copies))
            shutil.copytree(parent.root, img.root, symlinks=True)
        else:
            img = self._fresh(name, ref)
        args: dict[str, str | None] = {}
        for ins in instrs[1:]:
            scope = {**args, **img.env}
            if ins.op == "ARG":
                key, default = _arg(ins.args)
                if key in self.args:
                    args[key] = self.args[key]
                elif default is not None:
                    args[key] = expand(default, scope)
                else:
                    args[key] = self.globals.get(key)
            elif ins.op == "ENV":
                words = shlex.split(ins.args)
                if "=" not in words[0]:  # legacy `ENV KEY value`
                    words = [f"{words[0]}={' '.join(words[1:])}"]
                for w in words:
                    k, _, v = w.partition("=")
                    img.env[k] = expand(v, scope)
            elif ins.op == "WORKDIR":
                img.workdir = posixpath.normpath(posixpath.join(img.workdir, expand(ins.args, scope)))
                img.path(img.workdir).mkdir(parents=True, exist_ok=True)
            elif ins.op == "USER":
                img.user = expand(ins.args, scope)
            elif ins.op == "EXPOSE":
                img.exposed |= {int(expand(p, scope).split("/")[0]) for p in ins.args.split()}
            elif ins.op == "ENTRYPOINT":
                img.entrypoint, img.cmd = exec_or_shell(ins.args), None
            elif ins.op == "CMD":
                img.cmd = exec_or_shell(ins.args)
            elif ins.op in ("COPY", "ADD"):
                self._copy(img, ins, scope)
            elif ins.op == "RUN":
                argv = exec_or_shell(ins.args)
                body = argv[2] if argv[:2] == ["/bin/sh", "-c"] else shlex.join(argv)
                self.run(img, body, {k: v for k, v in args.items() if v is not None})
            elif ins.op == "SHELL":
                raise BuildError("SHELL is not modelled")
        return img

    def _copy(self, img: Image, ins: Instr, scope: dict) -> None:
        words = json.loads(ins.args) if ins.args.startswith("[") else shlex.split(ins.args)
        *srcs, dst = [expand(w, scope) for w in words]
        src_stage = ins.flags.get("from")
        if src_stage is None:
            src_root = self.context
        elif src_stage.lower() in self.stage_names:
            src_root = self.stage(src_stage.lower()).root
        else:
            raise BuildError(f"COPY --from={src_stage}: only stages are modelled")
        dest = posixpath.join(img.workdir, dst)
        into_dir = dst.endswith("/") or len(srcs) > 1
        added = []
        for s in srcs:
            rel = s.lstrip("/")
            found = sorted(src_root.glob(rel)) if any(c in rel for c in "*?[") else [src_root / rel]
            for f in found:
                if not f.exists():
                    raise BuildError(f"COPY {s}: not found in {src_stage or 'the context'}")
                if f.is_dir():
                    shutil.copytree(f, img.path(dest), symlinks=True, dirs_exist_ok=True)
                    added += [posixpath.join(dest, p.relative_to(f).as_posix())
                              for p in f.rglob("*") if p.is_file()]
                else:
                    to = dest
                    if into_dir or img.path(dest).is_dir():
                        to = posixpath.join(dest, f.name)
                    img.path(to).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(f, img.path(to))
                    added.append(to)
        img.copies.append(Copy(src_stage, added))

    def run(self, img: Image, body: str, args: dict[str, str] | None = None) -> list[Call]:
        """Run one shell command in the image (as a RUN step does) and record its calls."""
        root = str(img.root)
        env = {**(args or {}), **img.env}
        env["PATH"] = ":".join(root + d if d.startswith("/") else d
                               for d in env.get("PATH", DEFAULT_PATH).split(":"))
        log = self.work / f".log-{img.name}"
        log.write_bytes(b"")
        uid = img.uid()
        env.update(self.tools, SIM_ROOT=root, SIM_LOG=str(log), SIM_STAGE=img.name,
                   SIM_UID=str(uid), SIM_WHEEL=self.wheel, HOME=root + "/root", LC_ALL="C")
        cwd = img.path(img.workdir)
        cwd.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([self.tools["SIM_SH"], "-c", body], cwd=cwd, env=env,
                           capture_output=True, text=True, timeout=120)
        calls = _read_log(log.read_text(), root)
        img.calls += calls
        if r.returncode != 0:
            raise BuildError(f"stage {img.name}: RUN {body}\nexit {r.returncode}\n"
                             f"{_unmap(r.stdout + r.stderr, root)}")
        return calls

    def host(self, name: str = "host", uid: int = 1000, packages: tuple[str, ...] = (
            "python3", "python3-venv", "make", "sudo")) -> Image:
        """A development machine (a Debian with `packages`, a non-root user), the context
        copied to its /src: `run(host, "make setup")` is a developer's first command."""
        img = self._fresh(name, "debian")
        self.run(img, f"apt-get update && apt-get install -y {' '.join(packages)}")
        img.calls.clear()
        shutil.copytree(self.context, img.path("/src"), symlinks=True, dirs_exist_ok=True)
        img.workdir, img.user = "/src", str(uid)
        return img


def _arg(text: str) -> tuple[str, str | None]:
    key, eq, val = text.partition("=")
    return key.strip(), (shlex.split(val)[0] if val.strip() else "") if eq else None


def _unmap(s: str, root: str) -> str:
    return s.replace(root + "/", "/").replace(root, "/")


def _read_log(text: str, root: str) -> list[Call]:
    out = []
    for rec in text.split(RECORD):
        if not rec:
            continue
        fields = [_unmap(f, root) for f in rec.split(FIELD)[:-1]]
        stage, cwd, uid, *rest = fields
        sep = rest.index("--")
        env = dict(kv.split("=", 1) for kv in rest[:sep])
        argv = rest[sep + 1:]
        if "/" in argv[0] and not argv[0].startswith("/"):  # run as e.g. .venv/bin/pip
            argv[0] = posixpath.normpath(posixpath.join(cwd, argv[0]))
        out.append(Call(stage, cwd, int(uid), env, argv))
    return out


# ---- what the calls mean ---------------------------------------------------------------------

PIP_VALUE_OPTIONS = {
    "-c": "--constraint", "-r": "--requirement", "-e": "--editable", "-i": "--index-url",
    "-f": "--find-links", "-t": "--target", "-w": "--wheel-dir", "-C": "--config-settings",
    "--constraint": None, "--requirement": None, "--editable": None, "--index-url": None,
    "--extra-index-url": None, "--find-links": None, "--target": None, "--wheel-dir": None,
    "--python": None, "--prefix": None, "--root": None, "--upgrade-strategy": None,
    "--progress-bar": None, "--log": None, "--cache-dir": None, "--src": None,
    "--platform": None, "--python-version": None, "--implementation": None, "--abi": None,
    "--only-binary": None, "--no-binary": None, "--config-settings": None, "--timeout": None,
    "--trusted-host": None, "--proxy": None, "--retries": None, "--exists-action": None,
    "--report": None, "--root-user-action": None, "--global-option": None,
}
PIP_FLAGS = {"-q": "--quiet", "-U": "--upgrade", "-y": "--yes", "-v": "--verbose",
             "-I": "--ignore-installed"}


@dataclass
class Pip:
    """One pip command: its venv, action, requirement arguments and the options that
    change what it installs (constraints and indexes from the command line or the env)."""

    venv: str
    action: str
    reqs: list[str]
    opts: dict[str, str | bool]
    constraint: str | None  # the constraints file, as a path in the image
    extra_index: str | None
    cwd: str

    @property
    def no_deps(self) -> bool:
        return bool(self.opts.get("--no-deps"))


def pip_call(c: Call) -> Pip | None:
    argv = c.argv
    if c.tool in ("pip", "pip3"):
        args = argv[1:]
    elif c.tool.startswith("python") and argv[1:3] == ["-m", "pip"]:
        args = argv[3:]
    else:
        return None
    venv = posixpath.dirname(posixpath.dirname(argv[0]))
    action, reqs, opts, i = "", [], {}, 0
    while i < len(args):
        a = args[i]
        if a.startswith("-"):
            name, eq, val = a.partition("=")
            if re.fullmatch(r"-q+", name):
                name = "--quiet"
            long = PIP_VALUE_OPTIONS.get(name) or name
            if name in PIP_VALUE_OPTIONS:
                if not eq:
                    i += 1
                    val = args[i]
                if long == "--editable":
                    reqs.append(val)
                opts[long] = val
            else:
                opts[PIP_FLAGS.get(name, name)] = True
        elif not action:
            action = a
        else:
            reqs.append(a)
        i += 1
    constraint = opts.get("--constraint") or c.env.get("PIP_CONSTRAINT")
    if constraint:
        constraint = posixpath.join(c.cwd, constraint)
    extra = opts.get("--extra-index-url") or c.env.get("PIP_EXTRA_INDEX_URL")
    return Pip(venv, action, reqs, opts, constraint, extra, c.cwd)


def pip_calls(img: Image, venv: str | None = None, action: str | None = None) -> list[Pip]:
    out = [p for p in map(pip_call, img.calls) if p]
    return [p for p in out if (venv is None or p.venv == venv)
            and (action is None or p.action == action)]


def apt_installed(img: Image) -> set[str]:
    out = set()
    for c in img.calls:
        if c.tool == "apt-get":
            words = [a for a in c.argv[1:] if not a.startswith("-")]
            if words and words[0] == "install":
                out |= set(words[1:])
    return out


def python_checks(img: Image, venv: str) -> list[str]:
    """The `python -c CODE` a stage runs with the venv's interpreter."""
    return [c.argv[2] for c in img.calls if c.tool.startswith("python")
            and c.argv[1:2] == ["-c"] and posixpath.dirname(posixpath.dirname(c.argv[0])) == venv]
