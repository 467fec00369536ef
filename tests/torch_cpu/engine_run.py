"""Run by test_vllm_engine.py in a fresh process: vLLM's engine (LLM: the engine core and
its worker in processes of their own, which load the plugins through the entry point)
on MODEL_DIR with LOAD_FORMAT; prints the greedy tokens as a line "TOKENS <json>"."""

import json
import sys

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def main() -> None:
    model, load_format, *config = sys.argv[1:]
    extra = {"hf_config_path": config[0]} if config else {}
    llm = LLM(model=model, load_format=load_format, dtype="float32", enforce_eager=True,
              skip_tokenizer_init=True, max_model_len=256, max_num_seqs=2, **extra)
    out = llm.generate([TokensPrompt(prompt_token_ids=[1, 5, 9, 17])],
                       SamplingParams(max_tokens=8, temperature=0, detokenize=False))
    print("TOKENS", json.dumps(list(out[0].outputs[0].token_ids)), flush=True)


if __name__ == "__main__":  # the engine starts its processes with 'spawn'
    main()
