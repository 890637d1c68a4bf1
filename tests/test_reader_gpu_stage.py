"""benchmarks/reader/reader_gpu.py's transport and timing, on the CPU at tiny sizes: what travels to
and from a GPU lease (a teacher encoder as int8 rows, a student as int8 deltas from its start)
comes back within the rounding its docstring promises, a student keeps its config, and a
phase's steps follow its probe's speed."""

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
    """A trained reader directory (with a verifier head its start lacks, reading titles) comes
    back from its deltas: every tensor within int8 rounding of its change, the new head whole,
    its config and made_by.json as trained."""
    stage = _stage()
    torch.manual_seed(0)
    Reader.from_encoder(tiny_bert, max_len=64, max_query_len=16).save_pretrained(tmp_path / "init")
    init_state = {k: v.detach().clone() for k, v in Reader.from_pretrained(tmp_path / "init", calibration=None).state_dict().items()}
    student = Reader.from_pretrained(tmp_path / "init", calibration=None).reading_titles().with_verifier()
    student.cfg.null_span = True
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.01 * torch.randn_like(p))
    student.save_pretrained(tmp_path / "trained")
    (tmp_path / "trained" / "made_by.json").write_text('{"command": "ralm train-reader"}')
    (tmp_path / "out").mkdir()
    stage.save_delta(tmp_path / "trained", tmp_path / "init", tmp_path / "out", "student_kd")
    assert all(f.stat().st_size <= stage.DELTA_BYTES + 4096 for f in (tmp_path / "out").iterdir())
    stage.unpack(argparse.Namespace(delta=str(tmp_path / "out" / "student_kd"), init=str(tmp_path / "init"), out=str(tmp_path / "back")))

    back = Reader.from_pretrained(tmp_path / "back", calibration=None)
    assert back.cfg.null_span is True and back.cfg.read_title is True and back.verify_head is not None
    assert (tmp_path / "back" / "made_by.json").read_text() == '{"command": "ralm train-reader"}'
    trained, moved = student.state_dict(), 0
    for key, value in back.state_dict().items():
        delta = trained[key].float() - init_state[key].float() if key in init_state else trained[key].float()
        err = (value.float() - trained[key].float()).abs()
        assert (err <= (_row_bound(delta) if delta.dim() == 2 else 1e-6)).all(), key
        moved += int(key not in init_state or (value != init_state[key]).any())
    assert moved == len(trained)  # every tensor came back moved, none left at its start


def test_a_phase_runs_the_steps_its_probe_allows_within_its_epochs(tmp_path):
    stage = _stage()
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "steps_per_s": {v}}}\n'
                                                    for s, v in ((5, 0.1), (10, 2.0), (15, 0.5))))
    assert abs(stage.probe_speed(tmp_path) - 0.8) < 1e-9  # the first window (warm-up) left out: 2 steps in 0.5 + 2 s
    assert stage.planned_steps(questions=1000, batch_size=10, epochs=2.0, seconds=100, steps_per_s=0.8) == 80
    assert stage.planned_steps(questions=1000, batch_size=10, epochs=0.5, seconds=100, steps_per_s=0.8) == 50  # an epoch cap
    assert stage.planned_steps(questions=1000, batch_size=10, epochs=2.0, seconds=0, steps_per_s=0.8) == 1


def test_a_teacher_encoder_travels_as_int8_rows_in_parts_and_unpacks_to_a_model_directory(tiny_bert, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    stage = _stage()
    monkeypatch.setattr(stage, "PART_BYTES", 20_000)  # several parts, as a 440 MB teacher needs under a 64 MiB limit
    stage.pack_encoder(Path(tiny_bert), tmp_path / "packed" / "teacher")
    parts = sorted((tmp_path / "packed").glob("teacher-t*"))
    assert len(parts) > 1 and (parts[0] / "config.json").is_file()
    out = stage.unpack_encoder(parts, tmp_path / "teacher")

    original, back = load_file(str(Path(tiny_bert) / "model.safetensors")), load_file(str(out / "model.safetensors"))
    kept = {k for k in original if not k.startswith("pooler.") and not k.endswith("position_ids")}
    assert set(back) == kept and (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    for key in kept:
        a, b = original[key].float(), back[key]
        bound = _row_bound(a) if a.dim() == 2 else a.abs() * 2**-10 + 1e-7  # int8 rows; fp16 for the rest
        assert ((b - a).abs() <= bound).all(), key
