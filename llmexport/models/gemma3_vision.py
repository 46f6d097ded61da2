"""Gemma3's vision tower (multimodal ``gemma3``) -> ``visual.mnn``.

Mirrors transformers 5.x ``Gemma3Model.get_image_features`` (modeling_gemma3.py): the SigLIP
vision model (modeling_siglip.py ``SiglipVisionEmbeddings``: a stride-``patch`` convolution and
learned absolute positions; ``SiglipEncoderLayer``: pre-LayerNorm attention with biases, scale
head_dim ** -0.5, and a tanh-gelu MLP; ``post_layernorm``), then ``Gemma3MultiModalProjector``:
an average pool of the patch grid down to ``mm_tokens_per_image`` tokens, Gemma's RMSNorm
``x * (1 + weight)`` with the vision ``layer_norm_eps``, and ``x @ mm_input_projection_weight``
(stored [vision hidden, text hidden]). The projector's output replaces the image soft tokens'
embeddings unscaled: HF scales only the looked-up text embeddings by sqrt(hidden)
(``Gemma3TextScaledWordEmbedding``), so the graph divides its output by sqrt(text hidden), which
the text graph multiplies back; it also multiplies by the media mark (gemma4/media.py), by which
the text graph finds the soft tokens that attend to their image both ways.

Runtime contract (MNN 3.6.1 omni.cpp ``Omni::visionProcess``): an input named none of
``patches``/``pixel_values``/``input_patches`` selects ``defaultVisionProcess``: the image resized
to ``image_size`` (square), BGR -> RGB, ``(pixel - image_mean) * image_norm``, fed as [1, 3, H, W]
(NC4HW4); the output [tokens, 1, text hidden] is concatenated with the text embeddings
[seq, 1, hidden] (``Omni::embedding``), its first dimension being the soft-token count. ``image_mean`` 127.5 and
``image_norm`` 1/127.5 are HF's ``Gemma3ImageProcessor`` (rescale 1/255, mean = std = 0.5).

The patch convolution and the projection matrix are fp32 graph constants (exact); the encoder's
linears are placeholders, quantized as the text graph's are. The attention scales q before
``q @ k`` so that MNN's converter does not fuse it (see ``_EncoderLayer``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmexport.errors import InputError
from llmexport.media.image import synthetic_image
from llmexport.models.config_values import float_value, int_value, str_value
from llmexport.models.gemma4.media import MEDIA_MARK
from llmexport.models.gemma4.towers import TextRowTower, TowerLinear, const, encoder_attention, tower_linear
from llmexport.models.tensor_checks import Shapes, finite_lookup
from llmexport.models.tensor_names import NameTable
from llmexport.models.tower_check import FeatureCase, Measure, PromptCase, PromptLogits, TowerCheck
from llmexport.spec import GraphInputs, LinearRole
from llmexport.trace.ops import PlaceholderLinear, gelu_tanh

#: HF Gemma3ImageProcessor: rescale 1/255, then normalize with mean = std = 0.5 (per channel)
IMAGE_MEAN = 127.5
IMAGE_NORM = 1.0 / 127.5
#: the token ids the runtime keys name, under Gemma3Config's keys (and their attribute aliases)
VISION_TOKENS: dict[str, tuple[str, ...]] = {
    "boi_token_id": ("boi_token_index", "boi_token_id"), "eoi_token_id": ("eoi_token_index", "eoi_token_id"),
    "image_token_id": ("image_token_index", "image_token_id")}
FEATURE_BOUND = 1e-3  # max relative error of visual.mnn vs HF image features (stored weights), as Gemma4's
VERIFY_SEEDS = (0, 1, 2)
PROMPT_HEAD = "<bos><start_of_turn>user\n"
QUESTION = "Describe this picture in a few words."  # the user's words after the image
PROMPT_TAIL = QUESTION + "<end_of_turn>\n<start_of_turn>model\n"
INPUT_NAME = "image"  # any name but patches / pixel_values / input_patches (defaultVisionProcess)

#: the tower's tensors; ``{prefix}``: ``vision_tower.`` (as transformers 5 saves it) or
#: ``vision_tower.vision_model.`` (the released checkpoints)
VISION = NameTable({
    "patch_embedding": "{prefix}embeddings.patch_embedding.weight",
    "patch_bias": "{prefix}embeddings.patch_embedding.bias",
    "position_embedding": "{prefix}embeddings.position_embedding.weight",
    "self_attn.q_proj": "{prefix}encoder.layers.{layer}.self_attn.q_proj",
    "self_attn.k_proj": "{prefix}encoder.layers.{layer}.self_attn.k_proj",
    "self_attn.v_proj": "{prefix}encoder.layers.{layer}.self_attn.v_proj",
    "self_attn.out_proj": "{prefix}encoder.layers.{layer}.self_attn.out_proj",
    "mlp.fc1": "{prefix}encoder.layers.{layer}.mlp.fc1",
    "mlp.fc2": "{prefix}encoder.layers.{layer}.mlp.fc2",
    "layer_norm1.weight": "{prefix}encoder.layers.{layer}.layer_norm1.weight",
    "layer_norm1.bias": "{prefix}encoder.layers.{layer}.layer_norm1.bias",
    "layer_norm2.weight": "{prefix}encoder.layers.{layer}.layer_norm2.weight",
    "layer_norm2.bias": "{prefix}encoder.layers.{layer}.layer_norm2.bias",
    "post_layernorm.weight": "{prefix}post_layernorm.weight",
    "post_layernorm.bias": "{prefix}post_layernorm.bias",
    "projection": "multi_modal_projector.mm_input_projection_weight",
    "soft_emb_norm": "multi_modal_projector.mm_soft_emb_norm.weight",
})
VISION_PREFIXES = ("vision_tower.vision_model.", "vision_tower.")
ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj")
LAYER_NORMS = ("layer_norm1.weight", "layer_norm1.bias", "layer_norm2.weight", "layer_norm2.bias")


@dataclass(frozen=True)
class SiglipArgs:
    names: NameTable  # VISION bound to the checkpoint's prefix
    hidden: int
    intermediate: int
    layers: int
    heads: int
    eps: float
    image_size: int
    patch: int
    tokens: int  # mm_tokens_per_image
    text_hidden: int

    @property
    def grid(self) -> int:
        return self.image_size // self.patch

    @property
    def pool(self) -> int:
        return self.grid // math.isqrt(self.tokens)


def parse_siglip_args(config: dict[str, Any], text_hidden: int, where: str, tokens: int, names: NameTable,
                      max_layers: int | None = None) -> SiglipArgs:
    where = f"{where}: vision_config"
    str_value(config, "hidden_act", where, "gelu_pytorch_tanh", ("gelu_pytorch_tanh",))
    if config.get("vision_use_head"):
        raise InputError(f"{where}: 'vision_use_head' is not supported (Gemma3 reads the last hidden state)")
    if int_value(config, "num_channels", where, 3) != 3:
        raise InputError(f"{where}: 'num_channels' must be 3 (the runtime feeds RGB)")
    hidden, heads = int_value(config, "hidden_size", where), int_value(config, "num_attention_heads", where)
    args = SiglipArgs(
        names=names, hidden=hidden, intermediate=int_value(config, "intermediate_size", where),
        layers=int_value(config, "num_hidden_layers", where, maximum=max_layers), heads=heads,
        eps=float_value(config, "layer_norm_eps", where, 1e-6, high=1.0),
        image_size=int_value(config, "image_size", where, 224), patch=int_value(config, "patch_size", where, 16),
        tokens=tokens, text_hidden=text_hidden)
    side = math.isqrt(tokens)
    if hidden % heads:
        raise InputError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    if args.image_size % args.patch or side * side != tokens or args.grid % side:
        raise InputError(f"{where}: image_size {args.image_size} / patch_size {args.patch} must be a multiple of "
                         f"sqrt(mm_tokens_per_image {tokens}), a square")
    return args


def siglip_linears(args: SiglipArgs, weights) -> list[TowerLinear]:
    h, names = args.hidden, args.names
    out = []
    for i in range(args.layers):
        for key, fan_in, fan_out, role in (
                *((key, h, h, LinearRole.ATTENTION) for key in ATTENTION),
                ("mlp.fc1", h, args.intermediate, LinearRole.MLP), ("mlp.fc2", args.intermediate, h, LinearRole.MLP)):
            out.append(tower_linear(weights, names.name(key, layer=i), fan_in, fan_out, role, False, bias=True))
    return out


def siglip_constants(args: SiglipArgs) -> Shapes:
    """Tensors the graph carries as fp32 constants, with their expected shapes."""
    names, h = args.names, args.hidden
    shapes: Shapes = {
        names.name("patch_embedding"): (h, 3, args.patch, args.patch), names.name("patch_bias"): (h,),
        names.name("position_embedding"): (args.grid ** 2, h), names.name("post_layernorm.weight"): (h,),
        names.name("post_layernorm.bias"): (h,), names.name("projection"): (h, args.text_hidden),
        names.name("soft_emb_norm"): (h,)}
    for i in range(args.layers):
        shapes.update({name: (h,) for name in names.names(LAYER_NORMS, layer=i)})
    return shapes


# --- the trace-friendly graph ------------------------------------------------------------------
class LayerNorm(nn.Module):
    def __init__(self, lookup, weight: str, bias: str, eps: float):
        super().__init__()
        self.weight, self.bias, self.eps = const(lookup, weight), const(lookup, bias), eps

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


def placeholder(linear: TowerLinear) -> PlaceholderLinear:
    s = linear.spec
    return PlaceholderLinear(s.name, s.in_features, s.out_features, s.bias)


class _EncoderLayer(nn.Module):
    """HF ``SiglipEncoderLayer``: x + attn(ln1(x)), then + fc2(gelu_tanh(fc1(ln2(x))))."""

    def __init__(self, args: SiglipArgs, linears: dict[str, TowerLinear], index: int, lookup):
        super().__init__()
        p = args.names.bind(layer=index)
        self.args = args
        self.layer_norm1 = LayerNorm(lookup, p.name("layer_norm1.weight"), p.name("layer_norm1.bias"), args.eps)
        self.layer_norm2 = LayerNorm(lookup, p.name("layer_norm2.weight"), p.name("layer_norm2.bias"), args.eps)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (placeholder(linears[n]) for n in p.names(ATTENTION))
        self.fc1, self.fc2 = (placeholder(linears[n]) for n in p.names(("mlp.fc1", "mlp.fc2")))

    def forward(self, x, mask):
        a = self.args
        head_dim = a.hidden // a.heads
        h = self.layer_norm1(x)
        q, k, v = (proj(h).view(1, -1, a.heads, head_dim) for proj in (self.q_proj, self.k_proj, self.v_proj))
        # q scaled before q @ k (HF scales the product): with no op between the product and the
        # mask, MNN 3.6.1's converter leaves the attention unfused (FuseAttention.cpp); fused into
        # its Attention op, this encoder's output was -FLT_MAX in every row (measured)
        x = x + self.out_proj(encoder_attention(q * head_dim ** -0.5, k, v, mask, 1.0))
        return x + self.fc2(gelu_tanh(self.fc1(self.layer_norm2(x))))


class SiglipGraph(nn.Module):
    """image [1, 3, S, S] normalized as HF's processor does -> image_embeds [tokens, 1, text_hidden]
    (HF's image features times ``output_scale``)."""

    def __init__(self, args: SiglipArgs, linears: list[TowerLinear], lookup, output_scale: float):
        super().__init__()
        names, by_name = args.names, {linear.spec.name: linear for linear in linears}
        self.args, self.output_scale = args, output_scale
        self.patch_weight = const(lookup, names.name("patch_embedding"))
        self.patch_bias = const(lookup, names.name("patch_bias"))
        self.positions = const(lookup, names.name("position_embedding"))
        self.layers = nn.ModuleList(_EncoderLayer(args, by_name, i, lookup) for i in range(args.layers))
        self.post_layernorm = LayerNorm(lookup, names.name("post_layernorm.weight"),
                                         names.name("post_layernorm.bias"), args.eps)
        self.soft_emb_norm = const(lookup, names.name("soft_emb_norm"))
        self.projection = const(lookup, names.name("projection"))

    def forward(self, image):
        a = self.args
        x = F.conv2d(image, self.patch_weight, self.patch_bias, stride=a.patch)  # [1, hidden, grid, grid]
        x = x.flatten(2).transpose(1, 2) + self.positions  # [1, grid^2, hidden], row-major patches
        mask = torch.zeros(1, 1, 1, 1)  # no padding: nothing masked
        for layer in self.layers:
            x = layer(x, mask)
        x = self.post_layernorm(x)
        grid = x.transpose(1, 2).reshape(1, a.hidden, a.grid, a.grid)
        pooled = F.avg_pool2d(grid, a.pool, a.pool).flatten(2).transpose(1, 2)[0]  # [tokens, hidden]
        # Gemma3RMSNorm in fp32: x * rsqrt(mean(x^2) + eps) * (1 + weight)
        normed = pooled * torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + a.eps) * (1.0 + self.soft_emb_norm)
        return torch.matmul(normed, self.projection * self.output_scale).unsqueeze(1)  # the runtime's [rows, 1, hidden]


class Gemma3VisionTower(TextRowTower):
    """The SigLIP tower and projector of a multimodal ``gemma3`` checkpoint (Gemma4Tower holds the
    linears' bookkeeping both families share)."""

    name = "visual"

    def __init__(self, arch, vision_config: dict[str, Any]):
        weights = arch.checkpoint.weights
        prefix = next((p for p in VISION_PREFIXES if VISION.bind(prefix=p).name("post_layernorm.weight") in weights),
                      VISION_PREFIXES[-1])
        tokens = int_value(arch.checkpoint.config, "mm_tokens_per_image", str(arch.checkpoint.path / "config.json"),
                           256)

        def parse(config, text_hidden, where, max_layers):
            return parse_siglip_args(config, text_hidden, where, tokens, VISION.bind(prefix=prefix), max_layers)

        super().__init__(arch, vision_config, parse, siglip_linears, VISION_TOKENS, "a vision")

    @property
    def output_scale(self) -> float:
        """What ``visual.mnn`` multiplies HF's image features by: 1/sqrt(text hidden), which the
        text graph's embedding scale undoes, times the media mark the text graph finds and removes
        (gemma4/media.py: image runs attend both ways)."""
        return MEDIA_MARK / math.sqrt(self.args.text_hidden)

    def expected_tensors(self) -> Shapes:
        return {**siglip_constants(self.args), **self.linear_tensors(False)}

    def build_graph(self, token_tail: torch.Tensor | None = None, output_scale: float | None = None) -> nn.Module:
        if token_tail is not None:
            raise ValueError("Gemma3's runtime token rows have no tail")
        scale = self.output_scale if output_scale is None else output_scale
        return SiglipGraph(self.args, self._linears, finite_lookup(self.checkpoint.weights, self.checkpoint.path),
                           scale).eval()

    def graph_inputs(self) -> GraphInputs:
        size = self.args.image_size
        return GraphInputs((torch.rand(1, 3, size, size) * 2 - 1,), [INPUT_NAME], {}, ["image_embeds"])

    def llm_config(self) -> dict[str, Any]:
        return {"is_visual": True, "visual_model": "visual.mnn", "image_size": self.args.image_size,
                "image_mean": [IMAGE_MEAN] * 3, "image_norm": [IMAGE_NORM] * 3,
                "vision_start": self.ids["boi_token_id"], "vision_end": self.ids["eoi_token_id"],
                "image_pad": self.ids["image_token_id"]}

    def check(self) -> TowerCheck:
        """``visual.mnn`` alone on HF's pixel values of ``VERIFY_SEEDS`` synthetic images (at
        ``image_size``, which the runtime does not resize) vs HF's image features (stored weights:
        max relative error < ``FEATURE_BOUND``; fp32 weights: reported), and one image prompt
        through the runtime (``<img>`` tag) vs HF's full model on the same ids."""
        size = self.args.image_size
        pixels = [hf_pixel_values(synthetic_image(size, size, seed=seed), size) for seed in VERIFY_SEEDS]
        cases = tuple(FeatureCase(f"image {seed}", {INPUT_NAME: p.numpy()}, {"size": [size, size], "seed": seed})
                      for seed, p in zip(VERIFY_SEEDS, pixels))
        return TowerCheck(
            output="image_embeds", cases=cases, cases_key="images", feature_bound=FEATURE_BOUND,
            features=lambda model: [image_features(model, p) for p in pixels],
            measures={"soft_tokens": Measure.ROWS, "rel_err": Measure.REL_ERR, "max_abs_err": Measure.MAX_ABS_ERR,
                      "rel_err_fp32": Measure.REL_ERR_FP32},
            prompts=(self._prompt(synthetic_image(size, size, seed=len(VERIFY_SEEDS))),),
            prompt_logits=prompt_logits, stop_ids=frozenset(self.ids.values()),
            bos_id=int((self.checkpoint.config.get("text_config") or {}).get("bos_token_id", 2)),  # Gemma3TextConfig's
            output_scale=self.output_scale, notes={"output_scale": self.output_scale})


    def _prompt(self, image) -> PromptCase:
        """``PROMPT_HEAD`` + the image + ``PROMPT_TAIL``: HF's ids are the runtime's layout
        (``vision_start``, ``tokens`` x ``image_pad``, ``vision_end``; HF's ``Gemma3Processor``
        adds "\\n\\n" on both sides, which a prompt can carry as text), with HF's pixel values
        and ``token_type_ids``."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.checkpoint.path)
        size, ids = self.args.image_size, self.ids
        encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        image_ids = [ids["boi_token_id"]] + [ids["image_token_id"]] * self.args.tokens + [ids["eoi_token_id"]]
        input_ids = torch.tensor([encode(PROMPT_HEAD) + image_ids + encode(PROMPT_TAIL)])
        inputs = {"input_ids": input_ids, "pixel_values": hf_pixel_values(image, size),
                  "token_type_ids": (input_ids == ids["image_token_id"]).long()}

        def runtime_text(folder: Path) -> str:
            image.save(folder / "image.png")
            return f"{PROMPT_HEAD}<img><hw>{size},{size}</hw>{folder / 'image.png'}</img>{PROMPT_TAIL}"

        return PromptCase(f"{size}x{size}", f"image prompt {size}x{size}", inputs, runtime_text,
                          {"image": [size, size], "soft_tokens": self.args.tokens}, QUESTION)


def hf_pixel_values(image, size: int) -> torch.Tensor:
    """HF's ``Gemma3ImageProcessorPil`` output [1, 3, size, size] for one image."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    processor = Gemma3ImageProcessorPil(size={"height": size, "width": size})
    return processor(images=[image], return_tensors="pt")["pixel_values"]


def image_features(model, pixel_values: torch.Tensor) -> torch.Tensor:
    """HF's image soft tokens [n, text_hidden] (``Gemma3Model.get_image_features``)."""
    with torch.no_grad():
        return model.model.get_image_features(pixel_values).pooler_output.reshape(
            -1, model.config.text_config.hidden_size).float()


def prompt_logits(model, prompt: PromptCase) -> PromptLogits:
    """HF's ``Gemma3ForConditionalGeneration`` on a prompt's processor outputs followed by
    generated ids: ``token_type_ids`` 1 at the prompt's image tokens (HF's bidirectional spans),
    0 for generated ids."""
    n = len(prompt.ids)

    def logits(ids: list[int], first: int = 0) -> torch.Tensor:
        if ids[:n] != prompt.ids:
            raise ValueError("ids must extend the prompt's ids")
        types = torch.cat([prompt.inputs["token_type_ids"][0], torch.zeros(len(ids) - n, dtype=torch.long)])
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), pixel_values=prompt.inputs["pixel_values"],
                        token_type_ids=types.view(1, -1), use_cache=False,
                        logits_to_keep=torch.arange(first, len(ids)))
        return out.logits[0].float()

    return logits
