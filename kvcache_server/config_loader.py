"""The layered config loader the server and kvcache-router share: dataclass defaults, then a TOML
file, the environment and command-line overrides, each value coerced to its field's type, and
every unknown section, field or variable an error naming the closest known one.

Kubernetes service links are not settings: for every Service in a pod's namespace the kubelet sets
`<NAME>_SERVICE_HOST`, `<NAME>_SERVICE_PORT[_<PORT>]`, `<NAME>_PORT` and `<NAME>_PORT_<n>_<PROTO>[_PROTO|
_PORT|_ADDR]` (NAME: the Service's name upper-cased, `-` as `_`), so a Service named `kvcache` puts
KVCACHE_PORT=tcp://10.0.0.1:51051 beside the server. `service_links` picks out exactly those: a family
counts only when its `<NAME>_SERVICE_HOST` is an IP address and its `<NAME>_SERVICE_PORT` a port, and
each member only when its value is what the kubelet writes for that host (the same address, a port,
tcp/udp/sctp). A typo of a setting (KVCACHE_SERVICE_HOST alone, KVCACHE_PORT=51051) is still an error.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import re
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "ConfigError",
    "apply_updates",
    "coerce_field",
    "env_updates",
    "load_layered",
    "parse_assignment",
    "parse_size",
    "service_links",
]


class ConfigError(ValueError):
    """A configuration value that is missing, malformed or out of range."""


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_size(value: str | int) -> int:
    """'4GiB' -> 4294967296; ints pass through."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ConfigError(f"{value!r} is not a size (e.g. 1048576, '512MiB', '4GiB')")
    number, unit = m.groups()
    return int(float(number) * _UNITS[(unit or "b").lower()])


def coerce_field(where: str, kind: str, value: Any) -> Any:
    """A TOML, environment or flag value as field `where` ("section.field") of annotation `kind`
    ("int", "float", "bool", "str" or "tuple[str, ...]"); sizes (fields named *_bytes) take units."""
    try:
        if where.endswith("_bytes"):
            return parse_size(value)
        if kind == "tuple[str, ...]":
            items = value if isinstance(value, list | tuple) else str(value).split(",")
            return tuple(str(v).strip() for v in items if str(v).strip())
        if kind == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text not in {"1", "true", "yes", "on", "0", "false", "no", "off"}:
                raise ConfigError(f"{where}: {value!r} is not a boolean")
            return text in {"1", "true", "yes", "on"}
        if kind == "int":
            if isinstance(value, bool):
                raise ConfigError(f"{where}: {value!r} is not an integer")
            return int(value)
        if kind == "float":
            return float(value)
        if kind != "str":
            raise ConfigError(f"{where}: fields of type {kind} cannot be set")
        if isinstance(value, list | dict):
            raise ConfigError(f"{where}: {value!r} is not a string")
        return str(value)
    except ConfigError:
        raise
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {value!r} is not a valid {kind}") from None


C = TypeVar("C")


def apply_updates(config: C, updates: Mapping[str, Mapping[str, Any]], source: str) -> C:
    """`config` (a dataclass of section dataclasses) with {section: {field: value}} applied, each
    value coerced to its field's type; unknown sections and fields are errors naming `source`."""
    sections = {f.name for f in dataclasses.fields(config)}  # type: ignore[arg-type]
    changes: dict[str, Any] = {}
    for section, values in updates.items():
        if section not in sections:
            raise ConfigError(f"{source}: unknown section [{section}]; known: {sorted(sections)}")
        if not isinstance(values, Mapping):
            raise ConfigError(f"{source}: [{section}] must be a table")
        current = changes.get(section, getattr(config, section))
        fields = {f.name: str(f.type) for f in dataclasses.fields(current)}
        kwargs = {}
        for name, value in values.items():
            if name not in fields:
                raise ConfigError(f"{source}: unknown field {section}.{name}; known: {sorted(fields)}")
            kwargs[name] = coerce_field(f"{section}.{name}", fields[name], value)
        changes[section] = dataclasses.replace(current, **kwargs)
    return dataclasses.replace(config, **changes)  # type: ignore[type-var]


_SERVICE_HOST = re.compile(r"([A-Z][A-Z0-9_]*)_SERVICE_HOST")
_LINK = re.compile(r"SERVICE_PORT(?:_[A-Z0-9_]+)?|PORT|PORT_(\d+)_(TCP|UDP|SCTP)(?:_(PROTO|PORT|ADDR))?")
_PORT = re.compile(r"[1-9]\d{0,4}")


def _is_port(value: str) -> bool:
    return _PORT.fullmatch(value) is not None and int(value) <= 65535


def _is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def _link_value_fits(member: re.Match[str], value: str, host: str) -> bool:
    """Whether `value` is what the kubelet writes for the service-link variable `member` (its name
    after `<NAME>_`) of a Service at cluster IP `host` (pkg/kubelet/envvars: FromServices, makeLinkVariables)."""
    address = f"[{host}]" if ":" in host else host  # net.JoinHostPort
    port, proto, part = member.groups()
    if member.group(0) == "PORT":  # the first port's URL
        url = re.fullmatch(r"(?:tcp|udp|sctp)://" + re.escape(address) + r":(\d+)", value)
        return url is not None and _is_port(url.group(1))
    if port is None:  # SERVICE_PORT, SERVICE_PORT_<PORT NAME>
        return _is_port(value)
    wanted = {None: f"{proto.lower()}://{address}:{port}", "PROTO": proto.lower(), "PORT": port, "ADDR": host}
    return _is_port(port) and wanted[part] == value


def service_links(env: Mapping[str, str]) -> set[str]:
    """The names in `env` that are Kubernetes service-link variables (see the module's docstring)."""
    links: set[str] = set()
    for var, host in env.items():
        family = _SERVICE_HOST.fullmatch(var)
        if family is None or not _is_ip(host) or not _is_port(env.get(f"{family.group(1)}_SERVICE_PORT", "")):
            continue
        stem = f"{family.group(1)}_"
        links.add(var)
        for other, value in env.items():
            member = _LINK.fullmatch(other[len(stem) :]) if other.startswith(stem) else None
            if member is not None and _link_value_fits(member, value, host):
                links.add(other)
    return links


def env_updates(
    config: Any, env: Mapping[str, str], *, prefix: str, ignored: Callable[[str], bool], docs: str
) -> dict[str, dict[str, str]]:
    """{section: {field: value}} from the `prefix`<SECTION>_<FIELD> variables of `env`; any other
    variable starting with `prefix` that `ignored` does not accept is an error, with the closest name.

    Kubernetes service links (`service_links`) are skipped first, even where one's name is a field's:
    a Service named `kvcache-server` sets KVCACHE_SERVER_PORT=tcp://<its IP>:<port>, which is no port
    setting (a value set in the pod's own env replaces the kubelet's, and is then no link).
    """
    known = {
        f"{prefix}{s.name}_{f.name}".upper(): (s.name, f.name)
        for s in dataclasses.fields(config)
        for f in dataclasses.fields(getattr(config, s.name))
    }
    updates: dict[str, dict[str, str]] = {}
    links = service_links(env)
    for var in sorted(env):
        if var in links:
            continue
        if var in known:
            section, name = known[var]
            updates.setdefault(section, {})[name] = env[var]
        elif var.startswith(prefix) and not ignored(var):
            # Compared without the common prefix, which would make every name look close.
            short = len(prefix)
            close = difflib.get_close_matches(var[short:], [k[short:] for k in known], n=1, cutoff=0.6)
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; names are {prefix}<SECTION>_<FIELD>"
            raise ConfigError(f"environment: unknown variable {var}{hint} ({docs})")
    return updates


def load_layered(
    defaults: C,
    *,
    path: str | Path | None,
    env: Mapping[str, str],
    overrides: Mapping[str, Mapping[str, Any]] | None,
    prefix: str,
    ignored: Callable[[str], bool],
    docs: str,
) -> C:
    """`defaults`, then a TOML file, the environment and `overrides`, later ones winning; not validated."""
    config = defaults
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        config = apply_updates(config, data, str(path))
    config = apply_updates(config, env_updates(config, env, prefix=prefix, ignored=ignored, docs=docs), "environment")
    if overrides:
        config = apply_updates(config, overrides, "command line")
    return config


def parse_assignment(text: str) -> tuple[str, str, str]:
    """'section.field=value' -> (section, field, value)."""
    key, sep, value = text.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or not section or not name:
        raise ConfigError(f"--set expects section.field=value, got {text!r}")
    return section, name, value
