"""flash-attn's ``flash_attn.losses`` names that cuflash provides: ``cuflash.losses.cross_entropy``
(``CrossEntropyLoss``, a torch composition). Imports torch; ``import cuflash`` does not import this
package."""
