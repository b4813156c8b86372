"""Multi-token prediction (``mode: mtp``): drafts from the target model's own extra heads.

Some models ship MTP layers next to the main stack (config ``num_nextn_predict_layers`` /
``mtp_num_hidden_layers``; GGUF ``<arch>.nextn_predict_layers`` and ``blk.N.nextn.*``
tensors). Such a head drafts from the target's last hidden state, which is why the drafter
interface (``engine.generation.speculation.base.Drafter``) has ``needs_hidden``: the
verification core then hands ``propose`` that hidden state. None of the offline models
carry MTP weights, so ``make_mtp_drafter`` refuses with a message saying so.
"""

from __future__ import annotations

from typing import Any

from engine.errors import ProfileError

_CONFIG_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "nextn_predict_layers")


def mtp_layers(config: dict[str, Any], metadata: dict[str, Any] | None = None) -> int:
    """How many MTP layers the model's config or GGUF metadata declares (0 when none)."""
    for key in _CONFIG_KEYS:
        if int(config.get(key) or 0) > 0:
            return int(config[key])
    for key, value in (metadata or {}).items():
        if key.endswith(".nextn_predict_layers") and int(value or 0) > 0:
            return int(value)
    return 0


def make_mtp_drafter(where: str, model_name: str, config: dict[str, Any], metadata: dict[str, Any] | None):
    """The MTP drafter for this model, or a ProfileError naming why there is none."""
    layers = mtp_layers(config, metadata)
    if layers == 0:
        raise ProfileError(
            f"{where}: speculation.mode: mtp needs a model with multi-token-prediction layers; "
            f"{model_name} ships none (use mode: lookup or mode: draft)")
    raise ProfileError(
        f"{where}: speculation.mode: {model_name} declares {layers} MTP layer(s), but this engine "
        f"has no MTP head for model type {config.get('model_type', '?')} yet (use mode: lookup or draft)")
