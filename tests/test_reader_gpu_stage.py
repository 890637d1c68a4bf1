"""benchmarks/reader/reader_gpu.py's transport, on the CPU at tiny sizes: what travels to and from a GPU
lease (a teacher encoder as int8 rows, a student as int8 deltas from its start) comes back
within the rounding its docstring promises, and a student keeps its null span."""

import argparse
import importlib.util
from pathlib import Path

import torch

from ralm.models.reader import Reader

ROOT = Path(__file__).resolve().parents[1]


def _stage():
    spec = importlib.util.spec_from_file_location("reader_gpu", ROOT / "benchmarks" / "reader" / "reader_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row_bound(delta: torch.Tensor) -> torch.Tensor:
    """int8 rounding of a row: at most half a step, the row's largest magnitude / 127 a step."""
    return delta.abs().amax(dim=1, keepdim=True) / 254 + 1e-7


def test_a_student_travels_as_int8_deltas_from_its_start_and_comes_back_within_their_rounding(tiny_bert, tmp_path):
    stage = _stage()
    torch.manual_seed(0)
    Reader.from_encoder(tiny_bert, max_len=64, max_query_len=16).save_pretrained(tmp_path / "init")
    start = Reader.from_pretrained(tmp_path / "init", calibration=None)
    init_state = {k: v.detach().clone() for k, v in start.state_dict().items()}
    student = Reader.from_pretrained(tmp_path / "init", calibration=None)
    student.cfg.null_span = True
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.01 * torch.randn_like(p))
    (tmp_path / "out").mkdir()
    stage.save_delta(student, init_state, tmp_path / "out", "student_kd")
    stage.unpack(argparse.Namespace(delta=str(tmp_path / "out" / "student_kd"), init=str(tmp_path / "init"), out=str(tmp_path / "back")))

    back = Reader.from_pretrained(tmp_path / "back", calibration=None)
    assert back.cfg.null_span is True
    trained, moved = student.state_dict(), 0
    for key, value in back.state_dict().items():
        delta = trained[key].float() - init_state[key].float()
        err = (value.float() - trained[key].float()).abs()
        assert (err <= (_row_bound(delta) if delta.dim() == 2 else 1e-6)).all(), key
        moved += int((value != init_state[key]).any())
    assert moved == len(trained)  # every tensor came back moved, none left at its start


def test_a_teacher_encoder_travels_as_int8_rows_in_parts_and_unpacks_to_a_model_directory(tiny_bert, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    stage = _stage()
    monkeypatch.setattr(stage, "PART_BYTES", 20_000)  # several parts, as a 440 MB teacher needs under a 64 MiB limit
    stage.pack_encoder(Path(tiny_bert), tmp_path / "packed")
    parts = sorted((tmp_path / "packed").iterdir())
    assert len(parts) > 1 and (parts[0] / "config.json").is_file()
    out = stage.unpack_encoder(parts, tmp_path / "teacher")

    original, back = load_file(str(Path(tiny_bert) / "model.safetensors")), load_file(str(out / "model.safetensors"))
    kept = {k for k in original if not k.startswith("pooler.") and not k.endswith("position_ids")}
    assert set(back) == kept and (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    for key in kept:
        a, b = original[key].float(), back[key]
        bound = _row_bound(a) if a.dim() == 2 else a.abs() * 2**-10 + 1e-7  # int8 rows; fp16 for the rest
        assert ((b - a).abs() <= bound).all(), key
