"""examples/finetune_hf_moe.py runs end to end on the CPU with its tiny model: the loss falls under
a quantized recipe, and the saved directory loads back as a plain transformers model."""
import importlib.util
import pathlib

import torch

import transformers  # noqa: E402  (the test extra installs it)

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "finetune_hf_moe.py"


def test_finetune_example_trains_restores_and_saves(tmp_path):
    spec = importlib.util.spec_from_file_location("finetune_hf_moe", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    losses = example.main(["--recipe", "mxfp8", "--steps", "12", "--batch", "2", "--seq", "32",
                           "--out", str(tmp_path), "--no-progress"])
    assert len(losses) == 12 and all(map(torch.isfinite, torch.tensor(losses)))
    assert sum(losses[-3:]) < sum(losses[:3])
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(model).__name__ == "MixtralForCausalLM"
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 128, (1, 8))).logits).all()
