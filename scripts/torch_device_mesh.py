"""torch's DeviceMesh layout, for tests/device_mesh.rs to compare ours with.

    python3 scripts/torch_device_mesh.py     # needs torch (pip install torch), no network

For a few mesh shapes, builds torch.distributed.device_mesh.init_device_mesh on every rank of a
fake process group (torch's own FakeProcessGroup: no sockets, each rank in turn in this one
process) and prints one line per rank:

    mesh dp:2,tp:4 rank 5 coordinate 1,1 dp 1,5 tp 4,5,6,7

the rank's coordinate, then the ranks of its group along each dimension, as
torch.distributed.get_process_group_ranks gives them.
"""

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

SHAPES = [
    [("dp", 2), ("x", 2)],
    [("dp", 2), ("tp", 4)],
    [("pp", 3), ("dp", 2), ("tp", 2)],
    [("a", 2), ("b", 1), ("c", 3)],
    [("dp", 5)],
]


def main():
    for dims in SHAPES:
        names = tuple(n for n, _ in dims)
        shape = tuple(s for _, s in dims)
        world = 1
        for s in shape:
            world *= s
        label = ",".join(f"{n}:{s}" for n, s in dims)
        for rank in range(world):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            coordinate = ",".join(str(c) for c in mesh.get_coordinate())
            groups = " ".join(
                f"{n} " + ",".join(str(r) for r in dist.get_process_group_ranks(mesh.get_group(n)))
                for n in names
            )
            print(f"mesh {label} rank {rank} coordinate {coordinate} {groups}")
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
