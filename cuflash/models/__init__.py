"""flash-attn's ``flash_attn.models`` names that cuflash provides: ``cuflash.models.gpt``
(``GPTModel``, ``GPTLMHeadModel``, ``GPTPreTrainedModel``, ``create_mixer_cls``,
``create_mlp_cls``, ``create_block``, ``remap_state_dict_hf_gpt2``, ``shard_state_dict_tp``,
``combine_state_dicts_tp`` and a transformers-free ``GPT2Config``); ``cuflash.models.bert``
(``BertModel``, ``BertForPreTraining``, the heads, ``remap_state_dict``,
``inv_remap_state_dict``, a transformers-free ``BertConfig``); and the checkpoint helpers that
run other families as ``GPTLMHeadModel``: ``cuflash.models.llama``, ``gpt_neox``, ``gptj``,
``opt``, ``falcon``, ``bigcode``, ``baichuan``, ``btlm`` (``remap_state_dict_hf_<family>``,
``<family>_config_to_gpt2_config``, and the inverse remaps ``inv_remap_state_dict_hf_llama`` /
``inv_remap_state_dict_hf_bigcode``); ``cuflash.models.vit`` (``VisionTransformer``,
``vit_base_patch16_224``, timm-compatible keys). ``GPTLMHeadModel.from_pretrained`` reads a local
Hugging Face model directory of any of these families (config.json, safetensors / bin, sharded) or
a hub model id (the local Hugging Face cache, else a download into it: ``cuflash.utils.hub``).
Imports torch; ``import cuflash`` does not import this package."""
