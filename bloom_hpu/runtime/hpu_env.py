"""The environment Habana's bridge needs, set before anything can import it.

The bridge (``habana_frameworks``) reads these variables once, when it is imported, and torch's
device-backend autoload may import it during ``import torch``. So they are set here, by a module
that imports nothing heavy: ``bloom.py`` calls ``set_defaults`` before its first import of torch,
and ``HpuBackend`` calls it again for library users (too late if the bridge is already loaded, which
``late_keys`` then reports). Values the user set are kept.

No torch import in this module: it must be importable before torch.
"""

from __future__ import annotations

import os
import sys

# Always, on a Gaudi, for this project's recipe:
HPU_ENV_DEFAULTS = {
    # HPU graphs (wrap_in_hpu_graph) exist only in lazy mode; newer releases default to eager.
    "PT_HPU_LAZY_MODE": "1",
    # Lets a captured graph hold all-reduces (tensor parallelism).
    "PT_HPU_ENABLE_LAZY_COLLECTIVES": "true",
    # In-order collectives make tensor-parallel outputs deterministic.
    "HCL_USE_IN_ORDER_COLLECTIVE_GAUDI2": "1",
    # Every shape here is static: no dynamic-shape refinement (Habana's inference scripts set this).
    "PT_HPU_ENABLE_REFINE_DYNAMIC_SHAPES": "0",
    # Compiled graphs (lazy ones and HPU graphs) kept on disk, so a restart does not recompile
    # every shape: <folder>,<clear it at start>,<size limit in MB>.
    "PT_HPU_RECIPE_CACHE_CONFIG": "/tmp/bloom_hpu_recipe_cache,false,16384",
}
# Not set: PT_ENABLE_INT64_SUPPORT, documented for eager and compile modes, not lazy mode. Lazy mode
# computes int64 as int32, so every integer the steps and loops compute stays below 2**31
# (generation/search/sampling.py's hash included).
# Under tensor parallelism (Habana's scripts set it for more than one rank).
HPU_ENV_TENSOR_PARALLEL = {"PT_HPU_LAZY_ACC_PAR_MODE": "0"}
# When steps run without graphs: smaller compound ops in lazy mode (as Habana's scripts do).
HPU_ENV_NO_GRAPHS = {"PT_HPU_MAX_COMPOUND_OP_SIZE": "1"}


def world_size() -> int:
    """Ranks, as the launcher (deepspeed, torchrun) tells each process before it starts."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def wanted(use_graphs: bool = True) -> dict[str, str]:
    values = dict(HPU_ENV_DEFAULTS)
    if world_size() > 1:
        values.update(HPU_ENV_TENSOR_PARALLEL)
    if not use_graphs:
        values.update(HPU_ENV_NO_GRAPHS)
    return values


def bridge_loaded() -> bool:
    return "habana_frameworks.torch" in sys.modules


def required(use_graphs: bool = True) -> set[str]:
    """The variables without which the run fails (the others tune speed and memory): lazy mode for
    graphs, lazy collectives for all-reduces inside graphs."""
    if not use_graphs:
        return set()
    return {"PT_HPU_LAZY_MODE"} | ({"PT_HPU_ENABLE_LAZY_COLLECTIVES"} if world_size() > 1 else set())


def set_defaults(use_graphs: bool = True) -> list[str]:
    """Set every wanted variable the user has not set. Returns the required ones set only now,
    although the bridge was already loaded: it did not see them."""
    late = []
    for key, value in wanted(use_graphs).items():
        if key not in os.environ:
            os.environ[key] = value
            if bridge_loaded() and key in required(use_graphs):
                late.append(key)
    return late


def late_message(late: list[str]) -> str:
    """The one-line error for ``set_defaults``'s late keys."""
    return (f"Habana's bridge was imported before {', '.join(late)} were set; set them in the environment, "
            "or call bloom_hpu.runtime.hpu_env.set_defaults() before importing torch")
