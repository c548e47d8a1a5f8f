"""Every field of a config class as a reader sees it: name, type, default, description.

One walk of the pydantic classes serves `r1flow stages -v` and the reference pages of the documentation site
(docs/hooks/reference.py), so the two cannot disagree, and neither can drift from the classes.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined


@dataclass(frozen=True)
class ConfigField:
    """One field. `name` is what a recipe or `--set` writes (the alias where there is one; dotted below a nested
    config: `lora.r`); `default` is the value itself (PydanticUndefined when the field is required); `depth` is how
    many configs it is nested in."""

    name: str
    type: str
    default: Any
    description: str
    depth: int = 0

    @property
    def required(self) -> bool:
        return self.default is PydanticUndefined


def type_text(annotation: Any) -> str:
    """An annotation as a reader writes it: `int`, `str | None`, `'dpo' | 'ipo'`, `dict[str, float]`, `LoraSpec`."""
    if annotation is type(None):
        return "None"
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(a) for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        return type_text(typing.get_args(annotation)[0])
    if origin is not None:
        args = ", ".join(type_text(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is Any:
        return "Any"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The config class a field holds (`LoraSpec`, or `LoraSpec | None`), else None."""
    candidates = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) \
        else (annotation,)
    models = [a for a in candidates if isinstance(a, type) and issubclass(a, BaseModel)]
    return models[0] if len(models) == 1 else None


def config_fields(cls: type[BaseModel], nested: bool = False, instance: BaseModel | None = None,
                  prefix: str = "", depth: int = 0) -> list[ConfigField]:
    """The fields of `cls` in declaration order. With `nested`, a field holding a config is followed by that config's
    fields (`lora.r`, ...), whose defaults are the ones the outer default carries (`rejection_sampling`'s
    `generation.temperature` is 0.8, not GenerationSpec's own). `instance` supplies the defaults (the outer default)."""
    out: list[ConfigField] = []
    for field, info in cls.model_fields.items():
        if instance is not None:
            default = getattr(instance, field)
        else:
            default = info.get_default(call_default_factory=True)
        name = prefix + (info.alias or field)
        out.append(ConfigField(name, type_text(info.annotation), default, info.description or "", depth))
        inner = _nested_model(info.annotation) if nested else None
        if inner is not None:
            out += config_fields(inner, nested=True, instance=default if isinstance(default, inner) else None,
                                 prefix=f"{name}.", depth=depth + 1)
    return out
