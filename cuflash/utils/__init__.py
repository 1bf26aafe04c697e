"""flash-attn's ``flash_attn.utils`` names that cuflash provides: ``cuflash.utils.generation``
(``InferenceParams``, the decoding state that ``cuflash.modules.mha.MHA`` reads, and the
``decode`` / ``GenerationMixin`` generation loop) and
``cuflash.utils.distributed`` (the tensor-parallel collectives that ``ParallelMHA`` and
``cuflash.ops.fused_dense`` use), ``cuflash.utils.pretrained`` (``state_dict_from_pretrained``,
``config_from_pretrained``) and ``cuflash.utils.hub`` (Hugging Face hub model ids through the local
Hugging Face cache, downloaded into it with urllib when missing)."""
