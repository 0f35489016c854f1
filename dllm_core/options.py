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


class OptionError(ValueError):
    """A bad option value: ``name`` (the CLI's, e.g. ``--sampler slowfast.k``) and the ``rule`` it
    breaks (``must be >= 1, got 0``). A host names the option in its own vocabulary with ``under``."""

    def __init__(self, name: str, rule: str):
        super().__init__(f"{name} {rule}")
        self.key, self.rule = name.rpartition(".")[2].lstrip("-").replace("-", "_"), rule  # the field

    def under(self, where: str) -> str:
        """The message with the option named ``where.<key>``."""
        return f"{where}.{self.key} {self.rule}"


def check_choice(value, allowed, name: str):
    if value not in allowed:
        raise OptionError(name, f"must be one of {sorted(allowed)}, got {value!r}")


def check_range(value, lo, hi, name: str):
    if not (lo <= value <= hi):
        raise OptionError(name, f"must be in [{lo}, {hi}], got {value}")


def check_min(value, lo, name: str, strict: bool = False, note: str = ""):
    """value >= lo (> lo when ``strict``); ``note`` explains the bound."""
    if not (value > lo if strict else value >= lo):
        raise OptionError(name, f"must be {'>' if strict else '>='} {lo}{note}, got {value}")


def check_value(value, typ, where: str):
    """A JSON / YAML value for a config field annotated ``typ``: checked and normalised (ints are
    accepted as floats; booleans also as true / false / 1 / 0, since HTTP extra args carry none)."""
    t = typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
    if value is None and "None" in t:
        return None
    base = t.split("|")[0].strip()
    if base == "bool":
        word = str(value).lower()
        if word not in ("true", "false", "1", "0"):
            raise ValueError(f"{where} must be true or false, got {value!r}")
        return word in ("true", "1")
    if base == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{where} must be an integer, got {value!r}")
    if base == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where} must be a number, got {value!r}")
        return float(value)
    if base == "str" and not isinstance(value, str):
        raise ValueError(f"{where} must be a string, got {value!r}")
    return value
