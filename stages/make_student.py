"""`make_student` stage: cut a smaller student from the teacher by keeping a subset of its layers.

The student has the teacher's architecture, tokenizer, embeddings, final norm and LM head, and
the kept decoder layers with their weights copied (DistilBERT, Sanh et al. 2019, arXiv 1910.01108,
initialised its student from every second layer of BERT). It shares the teacher's tokenizer, so
all three `distill` modes apply. Any other student is an `import_model` node instead. The
teacher's and the student's parameter counts are the stage's metrics, side by side.

Dropping half the layers breaks a small model badly (SmolLM2-135M, every second layer: the
student's NLL of the teacher's own samples goes from 0.9 to 11.5 nats per token): the copied
weights are a starting point for `distill`, not a usable model. Measured on SmolLM2 (44 teacher
traces, 20 steps of `distill` at lr 2e-4): `every_2` (layers 0, 2, …, 28) went from 11.5 to 4.0,
`spread_15` (first and last kept) from 11.1 to 3.4; the last layer matters.
"""

from __future__ import annotations

from transformers import AutoConfig

from schemas.configs import MakeStudentConfig
from stages.base import Input, Output, StageContext, model_output_dir
from stages.modeling import models

VERSION = "1"  # history: CHANGELOG.md
CONFIG = MakeStudentConfig
INPUTS = {"model": "model"}
OUTPUTS = {"model": "model"}


def num_layers(teacher: Input) -> int:
    """The teacher's decoder layer count, read from its config (the base's, for an adapter)."""
    config_dir = teacher.base.model_dir if teacher.base is not None else teacher.model_dir
    return AutoConfig.from_pretrained(config_dir).num_hidden_layers


def run(cfg: MakeStudentConfig, inputs: dict[str, Input], ctx: StageContext) -> dict[str, Output]:
    teacher_layers = num_layers(inputs["model"])
    keep = models.layer_indices(cfg.keep_layers, teacher_layers)  # a bad spec fails before any weight loads
    teacher, tokenizer = inputs["model"].load_model()
    if hasattr(teacher, "merge_and_unload"):  # an adapter artifact: cut the merged model
        teacher = teacher.merge_and_unload()
    student = models.drop_layers(teacher, keep)
    out, model_dir = model_output_dir(ctx, "model")
    models.save_model(student, tokenizer, model_dir)
    t, s = models.count_parameters(teacher)["total"], models.count_parameters(student)["total"]
    metrics = {"parameters": float(s), "teacher_parameters": float(t), "parameter_ratio": s / t,
               "layers": float(len(keep)), "teacher_layers": float(teacher_layers)}
    ctx.log_params({"kept_layers": ",".join(map(str, keep))})
    ctx.log_metrics(metrics)
    ctx.log.info("make_student: kept %d of %d layers %s: %s -> %s parameters", len(keep), teacher_layers, keep,
                 f"{t:,}", f"{s:,}")
    return {"model": Output("model", "model", out, metrics=metrics, extra={"kept_layers": keep})}
