"""Nested dicts as the scenarios build them (parameter shapes, state layouts, batches): map a function
over their leaves, list the leaves, and name each leaf by its path (``params/layer_0/attn/w_q``), the
input names every tactic's patterns match.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

ARG_NAMES = ("params", "opt", "batch")

def map_shapes(tree: dict, fn: Callable) -> dict:
    return {k: (map_shapes(v, fn) if isinstance(v, dict) else fn(v)) for k, v in tree.items()}

def map_leaves(tree: dict, fn: Callable) -> dict:
    return {k: (map_leaves(v, fn) if isinstance(v, dict) else fn(v)) for k, v in tree.items()}

def leaves(tree: dict) -> list:
    return [x for v in tree.values() for x in (leaves(v) if isinstance(v, dict) else [v])]

def path_name(arg: str, path: Sequence[Any]) -> str:
    parts = [arg]
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)

def input_names(params: Any, opt: Any, batch: Any, *, arg_names: Sequence[str] = ARG_NAMES) -> list[str]:
    """Input names the compiler gives the step's flattened arguments:
    argument name (``arg_names``: a scenario's are ``Scenario.arg_names``), then the pytree path
    joined by ``/``."""
    import jax

    names = []
    for arg, tree in zip(arg_names, (params, opt, batch)):
        names += [path_name(arg, p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    return names
