"""Parse ``name:key=value,key=value`` policy specs (CLI ``--sampler`` / ``--cache``) into kwargs."""
from __future__ import annotations

import dataclasses


def parse_spec(spec: str, registry: dict[str, type], option: str):
    """Instantiate ``registry[name](**kwargs)`` from ``spec``; unknown names or keys are errors."""
    name, _, rest = spec.partition(":")
    name = name.strip()
    if name not in registry:
        raise ValueError(f"{option}: unknown policy {name!r}; allowed: {sorted(registry)}")
    cls = registry[name]
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, val = item.partition("=")
        if not eq:
            raise ValueError(f"{option}: expected key=value in {spec!r}, got {item!r}")
        if key not in fields:
            raise ValueError(f"{option}: {name} has no option {key!r}; allowed: {sorted(fields)}")
        kwargs[key] = _convert(val, fields[key].type, f"{option} {name}.{key}")
    return cls(**kwargs)


def _convert(val: str, typ, where: str):
    t = typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
    try:
        if t.startswith("bool"):
            if val.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError
            return val.lower() in ("1", "true", "yes")
        if t.startswith("int"):
            return int(val)
        if t.startswith("float"):
            return float(val)
    except ValueError:
        raise ValueError(f"{where}: cannot parse {val!r} as {t}") from None
    return val


def check_choice(value, allowed, name: str):
    if value not in allowed:
        raise ValueError(f"{name} must be one of {sorted(allowed)}, got {value!r}")


def check_range(value, lo, hi, name: str):
    if not (lo <= value <= hi):
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
