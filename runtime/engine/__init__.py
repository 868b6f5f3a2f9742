"""Reference MoE engine (inference process): model configs, attention, MoE layer, scheduler, trace replay."""
