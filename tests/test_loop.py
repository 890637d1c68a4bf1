"""What every trainer shares: checkpoints round-trip exactly, resume refuses another world size."""

import pytest
import torch

from ralm.errors import RalmError
from ralm.train import loop


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def test_checkpoint_restores_model_optimizer_and_rng(tmp_path):
    model, opt = _model_and_optimizer(0)
    path = loop.save_checkpoint(tmp_path, 7, model, opt)
    expected_draw = torch.rand(3)
    other, other_opt = _model_and_optimizer(1)
    meta = loop.load_checkpoint(path, other, other_opt)
    assert meta["step"] == 7 and meta["world"] == 1
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(opt.state_dict()["state"][0]["exp_avg"], other_opt.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG continues where the saved run was
    assert loop.latest_checkpoint(tmp_path) == path


def test_resuming_with_another_number_of_processes_is_a_clear_error(tmp_path, monkeypatch):
    model, opt = _model_and_optimizer(0)
    path = loop.save_checkpoint(tmp_path, 3, model, opt)
    monkeypatch.setattr(loop, "world_size", lambda: 2)
    with pytest.raises(RalmError, match="saved by 1 process.*has 2.*--nproc_per_node 1"):
        loop.load_checkpoint(path, model, opt)
