"""The unsupported-primitive report (issue 11, item 3): every unsupported primitive of the traced
function at once, each with a count and the user's own line (this file's, also when the primitive
is emitted inside flax), advice that can be followed, and still an UnsupportedPrimitiveError."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from partir_emu.compiler.tracing.trace import trace
from partir_emu.compiler.tracing.unsupported import advice
from partir_emu.errors import PartirError, UnsupportedPrimitiveError

X = np.linspace(0.5, 3.0, 6, dtype=np.float32)


def _line(marker: str) -> int:
    """The line of this file that carries ``marker`` in a comment."""
    with open(__file__) as f:
        hits = [i for i, text in enumerate(f, start=1) if text.rstrip().endswith(f"# <{marker}>")]
    assert len(hits) == 1, marker
    return hits[0]


def two_unsupported(x):
    a = jax.lax.cumlogsumexp(x)  # <cumlogsumexp-1>
    b = jax.lax.lgamma(x)  # <lgamma>
    c = jax.lax.cumlogsumexp(a + b)  # <cumlogsumexp-2>
    return jnp.sum(c) + jnp.exp(x)


def test_every_unsupported_primitive_is_reported_with_its_count_and_user_line():
    with pytest.raises(UnsupportedPrimitiveError) as err:
        trace(two_unsupported, X)
    msg = str(err.value)
    assert isinstance(err.value, PartirError)
    assert msg.startswith("2 unsupported primitive(s) in 'two_unsupported'"), msg
    here = re.escape(__file__)
    assert re.search(rf"primitive 'cumlogsumexp' at {here}:{_line('cumlogsumexp-1')} \(two_unsupported\), "
                     rf"{here}:{_line('cumlogsumexp-2')} \(two_unsupported\): 2 equation\(s\)", msg), msg
    assert re.search(rf"primitive 'lgamma' at {here}:{_line('lgamma')} \(two_unsupported\): 1 equation\(s\)", msg), msg
    assert msg.count("partir_emu/primitives/") == 2     # the advice: where an entry goes
    assert "exp" not in re.findall(r"primitive '(\w+)'", msg)


def test_a_primitive_emitted_inside_flax_points_at_the_users_line():
    """An ``rbg`` key given to Flax's Dropout: the key primitives run inside flax and jax, and the
    report names the line of this file that applied the module."""
    import flax.linen as nn
    drop = nn.Dropout(0.5)

    def step(x, key):
        y = drop.apply({}, x, deterministic=False, rngs={"dropout": key})  # <dropout>
        return jax.lax.cumlogsumexp(y)  # <cumlogsumexp-3>

    with pytest.raises(UnsupportedPrimitiveError) as err:
        trace(step, X, jax.random.key(0, impl="rbg"))
    msg = str(err.value)
    rbg = [line for line in msg.splitlines() if "PRNG key implementation rbg" in line]
    assert rbg and all(f"{__file__}:{_line('dropout')} (" in line for line in rbg), msg
    assert all("threefry2x32" in line for line in rbg), msg
    assert f"{__file__}:{_line('cumlogsumexp-3')} (" in msg
    assert "site-packages" not in msg


def test_a_primitive_emitted_inside_keras_points_at_the_users_line():
    """keras' ``ops.while_loop`` (a run-time trip count: unsupported) runs inside keras' jax backend:
    the report names this file's line, not keras/src/backend/jax/core.py."""
    import os
    os.environ.setdefault("KERAS_BACKEND", "jax")
    keras = pytest.importorskip("keras")

    def step(x):
        return keras.ops.while_loop(lambda v: keras.ops.sum(v) < 100.0, lambda v: (v * 2.0,), (x,))[0]  # <kwhile>

    with pytest.raises(UnsupportedPrimitiveError) as err:
        trace(step, X)
    msg = str(err.value)
    assert f"{__file__}:{_line('kwhile')} (" in msg and "site-packages" not in msg, msg


def test_advice_for_a_dynamic_while_can_be_followed():
    text = advice("while")
    assert "not supported yet" in text and "Python" in text and "for` loop" in text and "fori_loop" in text, text
    assert "partir_emu/primitives/" in advice("lgamma") and "registry" in advice("lgamma")


def test_a_layout_op_on_typed_keys_that_has_no_physical_form_is_named():
    def pick(seed, c):
        return jax.random.key_data(jnp.where(c, jax.random.key(seed), jax.random.key(1)))  # <where-keys>

    with pytest.raises(UnsupportedPrimitiveError, match=rf"'select_n \(on a PRNG key array\)' at .*:"
                                                        rf"{_line('where-keys')} .*key_data"):
        trace(pick, np.int32(3), True)
