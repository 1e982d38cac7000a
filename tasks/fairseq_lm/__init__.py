"""fairseq's language-model evaluation (fairseq-preprocess + fairseq-eval-lm) on our models."""
