"""Data-parallel training maths: 2 gloo ranks on CPU against one process with the doubled batch."""

import numpy as np
import torch

from ralm.distributed import DistEnv
from ralm.train.parallel import batch_indices, in_batch_contrastive, rank_batch

from test_distributed import run_ranks


def test_rank_batches_partition_the_global_batch():
    parts = [rank_batch(7, 4, n=100, seed=3, env=DistEnv(r, 3)) for r in range(3)]
    np.testing.assert_array_equal(np.concatenate(parts), batch_indices(7, 12, 100, 3))


def _towers(seed=0):
    torch.manual_seed(seed)
    return torch.nn.ModuleDict({"q": torch.nn.Linear(6, 4), "p": torch.nn.Linear(6, 4)})


DATA_Q = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
DATA_P = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))




class Pair(torch.nn.Module):
    def __init__(self, towers):
        super().__init__()
        self.towers = towers

    def forward(self, xq, xp):
        return self.towers["q"](xq), self.towers["p"](xp)


def _rank(rank, out):
    from ralm.distributed import dist_env
    from ralm.train.parallel import wrap_ddp

    env = dist_env()
    towers = _towers()
    model = wrap_ddp(Pair(towers), env, torch.device("cpu"))
    opt = torch.optim.SGD(towers.parameters(), lr=0.5)
    rows = rank_batch(0, 4, n=8, seed=0, env=env)
    q, p = model(DATA_Q[rows], DATA_P[rows])
    loss, _ = in_batch_contrastive(q, p, env)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.detach().contiguous() for k, v in towers.state_dict().items()}, str(out))


def test_two_rank_ddp_step_equals_one_process_with_the_doubled_batch(tmp_path):
    from safetensors.torch import load_file

    run_ranks(_rank, tmp_path / "ddp.safetensors")
    got = load_file(str(tmp_path / "ddp.safetensors"))
    towers = _towers()
    opt = torch.optim.SGD(towers.parameters(), lr=0.5)
    rows = batch_indices(0, 8, 8, 0)
    loss, _ = in_batch_contrastive(towers["q"](DATA_Q[rows]), towers["p"](DATA_P[rows]), DistEnv())
    opt.zero_grad()
    loss.backward()
    opt.step()
    for name, value in towers.state_dict().items():
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5)


def test_cross_rank_negatives_change_the_loss():
    """On one rank, the 4 queries see 4 passages; the global loss over 8 is a different number,
    which the DDP test above matches: the other rank's passages were used as negatives."""
    towers = _towers()
    q, p = towers["q"](DATA_Q), towers["p"](DATA_P)
    local, _ = in_batch_contrastive(q[:4], p[:4], DistEnv())
    global_first_half = torch.nn.functional.cross_entropy(q[:4] @ p.T, torch.arange(4))
    assert not torch.isclose(local, global_first_half)
