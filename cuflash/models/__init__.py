"""flash-attn's ``flash_attn.models`` names that cuflash provides: ``cuflash.models.gpt``
(``GPTModel``, ``GPTLMHeadModel``, ``GPTPreTrainedModel``, ``create_mixer_cls``,
``create_mlp_cls``, ``create_block``, ``remap_state_dict_hf_gpt2``, ``shard_state_dict_tp``,
``combine_state_dicts_tp`` and a transformers-free ``GPT2Config``) and ``cuflash.models.llama``
(``remap_state_dict_hf_llama``, ``inv_remap_state_dict_hf_llama``,
``llama_config_to_gpt2_config``). Imports torch; ``import cuflash`` does not import this
package."""
