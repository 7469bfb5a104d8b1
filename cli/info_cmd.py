"""`cag info`: how cag runs a model, as its last load here found (or a load now), without asking anything."""

from __future__ import annotations

import typer

from cag.cli.common import (
    JsonOpt,
    ModelOpt,
    _catalog,
    _emit,
    _engine,
    _human_bytes,
    announce_load,
    handle_errors,
    shown,
)

PREFILL = {"rows": "as decode rows, ", "blocks": "through the transformers forward in "}  # knowledge_kv.method
NATIVE = {"layers": "all layers in one native call", "glue": "native attention, products and glue",
          "attention": "native attention", "none": "torch's kernels"}


def _prefill(how: str) -> str:
    return f"{PREFILL.get(how.split()[0], '')}{how}"


@handle_errors
def info(model: ModelOpt = None, json_: JsonOpt = False):
    """Print the model's shape and how it decodes: weights format, kernels, fast step or forward (and why), snapshot bytes per token.

    What the last load of this model with these settings recorded (no load) where there is one;
    else the model loads once."""  # noqa: E501 (help text: its line breaks show)
    from cag.model import facts as model_facts

    s, index, _ = _catalog(model)
    known = model_facts.lookup(index, s)
    if known is None:
        engine = announce_load(_engine(model), quiet=json_)
        known = engine.facts()
    d = known.info
    if json_:
        _emit(d)
        return
    step = f"fast step, {NATIVE[d['native']]}" if d["step"] == "fast" else f"transformers forward ({d['step_reason']})"
    lines = [
        f"model:    {d['model']}",
        f"family:   {d['model_type']} ({d['class']}), {d['parameters'] / 1e6:.1f}M parameters",
        f"shape:    {d['layers']} layers, {d['heads']} heads ({d['kv_heads']} K/V), heads of {d['head_dim']}, context "
        f"{d['context']}",
        f"compute:  {d['dtype']} on {d['device']}, weights {d['weights']}"
        + (", products on 8-bit activations" if d.get("arithmetic", "").endswith("-q8") else ""),
        f"kernels:  {d['kernels']}" + (f" ({d['kernels_reason']})" if d["kernels_reason"] else ""),
        f"decode:   {step}",
        f"snapshot: {_human_bytes(d['kv_bytes_per_token'])} per token ({d['kv_dtype']} K/V)",
        f"prefill:  {_prefill(known.prefill)}" + (
            f" up to {d['prefill_rows_max']:,} tokens of knowledge, longer: {_prefill(d['prefill_beyond'])}"
            if "prefill_rows_max" in d else ""),
    ]
    typer.echo("\n".join(shown(line) for line in lines))
