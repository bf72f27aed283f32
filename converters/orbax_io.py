"""Orbax save / restore of the target's params pytree.

On disk the params are a pure nested dict with string keys ('layers' -> '0' -> ...): nnx uses
integer keys for list entries, which do not survive a round trip through Orbax's tree metadata.
Restoring goes against the abstract target (`abstract_target(cfg, dtype)`) as a dict of
jax.ShapeDtypeStruct, so shapes are checked and Orbax casts to the requested dtype.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp
from flax import nnx

from converters import layout
from converters.keymap import CheckpointError, flatten_paths, unflatten_paths
from converters.params import abstract_target, kv_width
from ddtree_jax.config import TargetConfig


def _string_keyed(tree) -> dict:
    """nnx pure dict (int keys for list entries) -> nested dict with only string keys."""
    out: dict = {}
    for path, leaf in flatten_paths(tree).items():
        node = out
        parts = path.split("/")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = leaf
    return out


def save_params(path: str | os.PathLike, params) -> None:
    """Write an nnx.State (or pure dict) of arrays to a new Orbax directory at `path`."""
    tree = _string_keyed(nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params)
    checkpointer = ocp.StandardCheckpointer()
    try:
        checkpointer.save(os.path.abspath(os.fspath(path)), tree)
        checkpointer.wait_until_finished()
    finally:
        checkpointer.close()  # also waits for any background commit before the caller cleans up


def restore_params(path: str | os.PathLike, cfg: TargetConfig, dtype=None, *, device=None):
    """Read params written by save_params; returns (graphdef, params) ready for decode.*.

    dtype: the dtype to materialise (default cfg.dtype); Orbax casts from the stored dtype.
    """
    graphdef, abstract = abstract_target(cfg, dtype)
    return graphdef, restore_tree(path, abstract, device=device, kv_width=kv_width(cfg))


def _restore_flat(path: str, shapes: dict, sharding) -> dict:
    target = _string_keyed({k: jax.ShapeDtypeStruct(s, d, sharding=sharding) for k, (s, d) in shapes.items()})
    checkpointer = ocp.StandardCheckpointer()
    try:
        return flatten_paths(checkpointer.restore(path, target))
    finally:
        checkpointer.close()


def _root_cause(e: BaseException) -> str:
    """The first line of the innermost exception under `e` (TensorStore's own message, not Orbax's
    wrapper with its pages of spec)."""
    seen = set()
    while (e.__cause__ or e.__context__) is not None and id(e) not in seen:
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def restore_tree(path: str | os.PathLike, abstract, *, device=None, kv_width: int | None = None):
    """Restore an nnx.State of the same structure as `abstract` (shapes and dtypes checked / cast).

    A checkpoint saved in another projection layout (converters/layout.py: merged gate | up,
    q | k | v, b | a, or separate) is restored in its own and converted; kv_width splits a stored
    q | k | v weight."""
    sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
    where = os.path.abspath(os.fspath(path))
    expected = {k: (tuple(v.shape), v.dtype) for k, v in flatten_paths(nnx.to_pure_dict(abstract)).items()}
    try:
        flat = _restore_flat(where, expected, sharding)
    except ValueError as e:  # another layout's shapes (or a read error, reported by the alternatives' failure)
        first = e
        for stored, convert in layout.alternatives(expected, kv_width):
            try:
                flat = convert(_restore_flat(where, stored, sharding))
                break
            except ValueError:
                continue
        else:
            raise CheckpointError(
                [f"stored params do not match the model described by config.json: {_root_cause(first)}"],
                os.fspath(path),
            ) from None
        flat = {k: jax.device_put(jax.numpy.asarray(v, expected[k][1]), sharding) for k, v in flat.items()}
    except Exception as e:  # noqa: BLE001 - Orbax wraps TensorStore's read errors in a bare Exception
        raise CheckpointError([f"cannot read the stored params: {_root_cause(e)} - the checkpoint is truncated or "
                               "corrupt (convert it again)"], os.fspath(path)) from None
    params = jax.tree_util.tree_map(lambda x: x, abstract)
    nnx.replace_by_pure_dict(params, unflatten_paths(flat))
    return params
