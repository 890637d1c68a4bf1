"""`ralm ict`, `mlm`, `pretrain`, `train-reader`, `finetune` and `dpr`: each command is generated
from its config dataclass (commands/from_config.py); what is written here is where the trainer
lives, its help, and the line it prints when done."""

from __future__ import annotations

from ralm.commands.from_config import TrainerCommand

TRAINERS = {
    "ict": TrainerCommand(
        "ralm.train.ict", "IctTrainer",
        "Warm-start both retriever towers with the Inverse Cloze Task (exports RUN/final/retriever).",
        lambda r, _: f"{r.steps} steps; exported {r.retriever}", models=("--model",)),
    "pretrain": TrainerCommand(
        "ralm.train.pretrain", "PretrainTrainer",
        "REALM pre-training: salient-span masking, retrieval over a refreshed index, marginal MLM "
        "(exports RUN/final/retriever and RUN/final/encoder).",
        lambda r, _: f"{r.steps} steps; exported {r.retriever} and {r.encoder}", models=("--init", "--model", "--encoder")),
    "mlm": TrainerCommand(
        "ralm.train.mlm", "MlmTrainer",
        "MLM warm-up of REALM's knowledge-augmented encoder (head first, then the whole encoder); "
        "exports RUN/final/encoder for `ralm pretrain --encoder`.",
        lambda r, _: f"{r.steps} steps; exported {r.encoder}", models=("--model",)),
    "train-reader": TrainerCommand(
        "ralm.train.reader", "ReaderTrainer",
        "Train the span reader on each question's gold passage, SQuAD-style (exports RUN/final/reader).",
        lambda r, _: (f"{r.steps} steps, {100 * r.answerable_share:.1f}% of questions had a gold span; exported {r.reader} "
                      f"(continue open-domain with `ralm finetune --init {r.run}`)"), models=("--init", "--teacher")),
    "finetune": TrainerCommand(
        "ralm.train.finetune", "FinetuneTrainer",
        "Fine-tune the span reader (and the query tower) for open-domain QA (exports RUN/final/reader).",
        lambda r, cfg: (f"{r.steps} steps, {100 * r.answerable_share:.1f}% of questions had an answer among their "
                        f"top-{cfg.k} blocks; exported {r.reader}"), models=("--init",)),
    "dpr": TrainerCommand(
        "ralm.train.dpr", "DPRTrainer",
        "Train a DPR retriever (both towers, in-batch + BM25 hard negatives); exports RUN/final/retriever.",
        lambda r, _: (f"{r.steps} steps on {r.trainable_questions} questions with a BM25 positive; index it with "
                      f"`ralm index build CORPUS --model {r.retriever} --out DIR`"), models=("--model",)),
}
