"""Llama-family decoders written for the paged KV cache."""

from ledgerserve.worker_proc.models.config import ModelConfig, load_eos_token_ids, load_model_config
from ledgerserve.worker_proc.models.llama import LlamaForCausalLM
from ledgerserve.worker_proc.models.loader import build_model

__all__ = ["LlamaForCausalLM", "ModelConfig", "build_model", "load_eos_token_ids", "load_model_config"]
