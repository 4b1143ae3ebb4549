"""Small seeded configurations of Hugging Face ``transformers`` architectures, for export tests
and ``benchmarks/transformers_models.py``.

Each builder returns ``(module, example_inputs)`` in eval mode: text models take token ids
(int64) and an attention mask where the model has one, vision models pixel values,
Whisper's encoder input features.  ``attention`` picks transformers' attention
implementation (``"eager"`` or ``"sdpa"``, torch's ``scaled_dot_product_attention``).
Configurations are tiny (2 layers, widths of 64) so a test exports each in seconds;
widths are multiples of 32 so int4 groups of 32 fit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

SEED = 0
TOKENS = 12


class _Logits(torch.nn.Module):
    """The model's first output tensor (transformers returns a ModelOutput)."""

    def __init__(self, model: torch.nn.Module, key: str) -> None:
        super().__init__()
        self.model = model
        self.key = key

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        out = self.model(*inputs)
        return out[self.key] if isinstance(out, dict) or hasattr(out, "keys") else out[0]


def _ids(vocab: int, batch: int = 1, tokens: int = TOKENS) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, tokens), generator=torch.Generator().manual_seed(SEED))


def _seeded(make: Callable[[], torch.nn.Module], randomize: bool = False) -> torch.nn.Module:
    torch.manual_seed(SEED)
    model = make().eval()
    if randomize:
        _randomize(model)
    return model


def _randomize(model: torch.nn.Module) -> None:
    """Weights of a working network: transformers 5 leaves some vision models' freshly made
    weights at values whose activations vanish (outputs of 0 or 1e-24): filters normal with
    He's scale, norm scales near 1, biases and statistics small."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.Conv2d, torch.nn.Linear)):
                fan_in = module.weight[0].numel()
                module.weight.normal_(0.0, (2.0 / fan_in) ** 0.5)
                if module.bias is not None:
                    module.bias.uniform_(-0.1, 0.1)
            elif isinstance(module, (torch.nn.BatchNorm2d, torch.nn.LayerNorm, torch.nn.GroupNorm)):
                if module.weight is not None:
                    module.weight.uniform_(0.5, 1.5)
                    module.bias.uniform_(-0.1, 0.1)
                if isinstance(module, torch.nn.BatchNorm2d):
                    module.running_mean.uniform_(-0.1, 0.1)
                    module.running_var.uniform_(0.5, 2.0)


def bert(attention: str = "eager") -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64, attn_implementation=attention)
    model = _seeded(lambda: _Logits(BertModel(config), "last_hidden_state"))
    ids = _ids(128)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    return model, (ids, mask)


def roberta(attention: str = "eager") -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """Its positions come from the ids: ``cumsum(ids != pad) * (ids != pad) + pad``."""
    from transformers import RobertaConfig, RobertaModel

    config = RobertaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, max_position_embeddings=64, attn_implementation=attention)
    model = _seeded(lambda: _Logits(RobertaModel(config, add_pooling_layer=False), "last_hidden_state"))
    ids = _ids(128)
    ids[0, -2:] = config.pad_token_id
    mask = (ids != config.pad_token_id).long()
    return model, (ids, mask)


def distilbert(attention: str = "eager") -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    from transformers import DistilBertConfig, DistilBertModel

    config = DistilBertConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                              max_position_embeddings=64, attn_implementation=attention)
    model = _seeded(lambda: _Logits(DistilBertModel(config), "last_hidden_state"))
    ids = _ids(128)
    return model, (ids, torch.ones_like(ids))


def gpt2(attention: str = "eager") -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, use_cache=False,
                        attn_implementation=attention)
    return _seeded(lambda: _Logits(GPT2LMHeadModel(config), "logits")), (_ids(128),)


def llama(attention: str = "eager") -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
                         attn_implementation=attention)
    return _seeded(lambda: _Logits(LlamaForCausalLM(config), "logits")), (_ids(128),)


def qwen2(attention: str = "eager") -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
                         attn_implementation=attention)
    return _seeded(lambda: _Logits(Qwen2ForCausalLM(config), "logits")), (_ids(128),)


def vit(attention: str = "eager") -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    from transformers import ViTConfig, ViTModel

    config = ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=128, attn_implementation=attention)
    model = _seeded(lambda: _Logits(ViTModel(config, add_pooling_layer=False), "last_hidden_state"))
    return model, (torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(SEED)),)


def resnet(attention: str = "eager") -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    from transformers import ResNetConfig, ResNetModel

    config = ResNetConfig(embedding_size=32, hidden_sizes=[32, 64], depths=[1, 1], layer_type="basic")
    model = _seeded(lambda: _Logits(ResNetModel(config), "pooler_output"), randomize=True)
    return model, (torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(SEED)),)


def convnext(attention: str = "eager") -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    from transformers import ConvNextConfig, ConvNextModel

    config = ConvNextConfig(hidden_sizes=[32, 64], depths=[1, 1], num_stages=2)
    model = _seeded(lambda: _Logits(ConvNextModel(config), "pooler_output"), randomize=True)
    return model, (torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(SEED)),)


def poolformer(attention: str = "eager") -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """Its token mixer is ``avg_pool(x) - x``, on a group norm's output."""
    from transformers import PoolFormerConfig, PoolFormerModel

    config = PoolFormerConfig(hidden_sizes=[32, 64, 96, 128], depths=[1, 1, 1, 1])
    model = _seeded(lambda: _Logits(PoolFormerModel(config), "last_hidden_state"), randomize=True)
    return model, (torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(SEED)),)


def mobilenet_v2(attention: str = "eager") -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    from transformers import MobileNetV2Config, MobileNetV2Model

    config = MobileNetV2Config(depth_multiplier=0.35, image_size=64)
    model = _seeded(lambda: _Logits(MobileNetV2Model(config), "pooler_output"), randomize=True)
    return model, (torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(SEED)),)


def efficientnet(attention: str = "eager") -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    from transformers import EfficientNetConfig, EfficientNetModel

    config = EfficientNetConfig(image_size=64, width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320)
    model = _seeded(lambda: _Logits(EfficientNetModel(config), "pooler_output"), randomize=True)
    return model, (torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(SEED)),)


def whisper_encoder(attention: str = "eager") -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    config = WhisperConfig(num_mel_bins=16, d_model=64, encoder_layers=2, encoder_attention_heads=4,
                           encoder_ffn_dim=128, max_source_positions=32, attn_implementation=attention)
    model = _seeded(lambda: _Logits(WhisperEncoder(config), "last_hidden_state"))
    return model, (torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(SEED)),)


def t5_encoder(attention: str = "eager") -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """Its attention bias is a table permuted to (1, heads, q, k), masked by the padding."""
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, use_cache=False,
                      attn_implementation=attention)
    model = _seeded(lambda: _Logits(T5EncoderModel(config), "last_hidden_state"))
    ids = _ids(128)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    return model, (ids, mask)


class _Embeds(torch.nn.Module):
    """A text model fed its input embeddings (float) instead of token ids."""

    def __init__(self, model: _Logits) -> None:
        super().__init__()
        self.model = model

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        out = self.model.model(inputs_embeds=embeds)
        return out[self.model.key]


def with_float_inputs(built: tuple[Any, tuple[torch.Tensor, ...]]) -> tuple[Any, tuple[torch.Tensor, ...]]:
    """A text model of ``ARCHITECTURES`` taking ``inputs_embeds`` (float32 ``(1, T, 64)``)."""
    model, _ = built
    embeds = torch.randn(1, TOKENS, 64, generator=torch.Generator().manual_seed(SEED))
    return _Embeds(model).eval(), (embeds,)


class _Ids(torch.nn.Module):
    """A text model called with its token ids alone, as one named argument (what a
    ``dynamic_shapes`` spec names)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids)


def by_ids(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (of ``ARCHITECTURES``, taking ids) as ``forward(ids)``."""
    return _Ids(model).eval()


#: name -> builder(attention) -> (module, example inputs)
ARCHITECTURES: dict[str, Callable[..., tuple[Any, tuple[torch.Tensor, ...]]]] = {
    "bert": bert, "roberta": roberta, "distilbert": distilbert, "gpt2": gpt2, "llama": llama, "qwen2": qwen2, "vit": vit,
    "resnet": resnet, "convnext": convnext, "poolformer": poolformer, "mobilenet_v2": mobilenet_v2, "efficientnet": efficientnet,
    "whisper_encoder": whisper_encoder, "t5_encoder": t5_encoder,
}
#: The architectures whose attention implementation can be chosen.
WITH_ATTENTION = ("bert", "roberta", "distilbert", "gpt2", "llama", "qwen2", "vit", "whisper_encoder", "t5_encoder")
#: The architectures that take token ids (``with_float_inputs`` feeds them embeddings).
TEXT = ("bert", "roberta", "distilbert", "gpt2", "llama", "qwen2", "t5_encoder")
