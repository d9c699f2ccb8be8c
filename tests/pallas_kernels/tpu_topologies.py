"""TPU topologies for the real Mosaic compiles of the Pallas TPU kernel tests (libtpu, no TPU needed): one per
generation, and the devices or a replicated one-device sharding to compile against (skips where libtpu
cannot describe the topology)."""
from __future__ import annotations

import numpy as np
import pytest

TOPOLOGIES = {"v5e": "v5e:2x2", "v6e": "v6e:2x2", "v5p": "v5p:2x2x1"}


def tpu_devices(gen):
    topologies = pytest.importorskip("jax.experimental.topologies")
    try:
        return topologies.get_topology_desc(TOPOLOGIES[gen], "tpu").devices
    except Exception as err:  # noqa: BLE001 - no libtpu on this machine
        pytest.skip(f"libtpu topology {gen} unavailable: {err}")


def one_device_mesh(gen):
    from jax.sharding import Mesh

    return Mesh(np.array(tpu_devices(gen)[:1]), ("x",))


def replicated(gen):
    """A sharding that puts a whole array on one device of ``gen``'s topology."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    return NamedSharding(one_device_mesh(gen), P())
