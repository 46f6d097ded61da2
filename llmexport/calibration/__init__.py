"""Calibration on the user's text: GPTQ, AWQ / SmoothQuant scales folded into the model, and
--target_bpw's measured sensitivities."""
