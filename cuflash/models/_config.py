"""Reading a model config duck-typed: any object with the Hugging Face config's attribute names is
a config (transformers is not needed). One reader per model family: its config class's name, its
defaults, the attributes it cannot do without and its name aliases."""
from __future__ import annotations

MISSING = object()


class ConfigReader:
    """``get(config, name, default)``: config.name (or an alias's attribute), else ``default`` if
    given, else the family's default; a required attribute that is missing raises ValueError
    naming it and the attribute names the family needs."""

    def __init__(self, kind: str, defaults: dict, required: tuple, aliases: dict | None = None):
        self.kind, self.defaults, self.required = kind, defaults, required
        aliases = aliases or {}
        inverse = {v: k for k, v in aliases.items()}
        # each name's keys, in order: itself, the alias it has, the name it is an alias of
        self._keys = lambda name: [k for k in (name, aliases.get(name), inverse.get(name)) if k is not None]

    def get(self, config, name, default=MISSING):
        for key in self._keys(name):
            if hasattr(config, key):
                return getattr(config, key)
        if default is not MISSING:
            return default
        if name in self.defaults and name not in self.required:
            return self.defaults[name]
        raise ValueError(f"config.{name} is missing (config: {type(config).__name__}; it needs {self.kind}'s "
                         f"attribute names, at least {', '.join(self.required)})")

    def positive_int(self, config, name) -> int:
        value = self.get(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"config.{name} must be a positive int, got {value!r}")
        return value

    def padded_vocab(self, config) -> int:
        """vocab_size rounded up to pad_vocab_size_multiple (1 when the config has none)."""
        vocab = self.positive_int(config, "vocab_size")
        multiple = self.get(config, "pad_vocab_size_multiple", 1)
        if not isinstance(multiple, int) or multiple < 1:
            raise ValueError(f"config.pad_vocab_size_multiple must be an int >= 1, got {multiple!r}")
        return -(-vocab // multiple) * multiple
