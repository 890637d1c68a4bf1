"""Training: ICT, REALM pre-training, QA fine-tuning, DPR, language models; shared loop parts."""
