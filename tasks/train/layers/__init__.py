"""What every family's draft layers are built from: the decoder layer's
norms and MLP, the rope SGLang serves a drafter with, a layer's sizes from
its target's config, and what SGLang's GPU kernels take of them."""
