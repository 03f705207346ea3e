"""Our top-level package `kernels` shadows Hugging Face's hub package of the same name, which
transformers probes for. With raypage installed, transformers must still load and run models."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_transformers_runs_beside_our_kernels_package(tmp_path):
    # A fresh interpreter, so that transformers' import-time probes really run with our package present.
    script = textwrap.dedent(
        f"""
        import importlib.util, pathlib
        import torch
        import kernels
        from transformers import LlamaConfig, LlamaForCausalLM, AutoModelForCausalLM
        from transformers.utils.import_utils import is_kernels_available

        origin = pathlib.Path(importlib.util.find_spec("kernels").origin).resolve()
        assert origin == pathlib.Path(kernels.__file__).resolve() and origin.parent.name == "kernels"
        assert not is_kernels_available(), "transformers mistook raypage's kernels for the hub package"

        config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2)
        LlamaForCausalLM(config).save_pretrained({str(tmp_path)!r})
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}).eval()
        out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
        assert out.shape == (1, 7), out.shape
        print("ok", origin)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok")
