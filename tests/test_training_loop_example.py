"""The README's "Training with qmoe" block and examples/train_loop.py run as written (CPU, small)."""
import importlib.util
import pathlib

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_example_resumes_bit_for_bit():
    spec = importlib.util.spec_from_file_location("train_loop", ROOT / "examples" / "train_loop.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    want, got = example.main(["--steps", "4", "--save-at", "2", "--eval-every", "2"])
    assert len(want) == 4 and len(got) == 2
    assert all(torch.isfinite(v) for v in want)
    assert all(torch.equal(a, b) for a, b in zip(got, want[2:]))  # main() raises too if not


def test_readme_training_block_runs(capsys):
    text = (ROOT / "README.md").read_text()
    section = text.split("## Training with qmoe", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    namespace = {}
    exec(compile(code, "README.md (Training with qmoe)", "exec"), namespace)
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in printed] == ["0", "1", "2", "3"]
    state = namespace["model"].state_dict()
    assert state["head._extra_state"]["recipes"], "the recipe state is in the saved model"
