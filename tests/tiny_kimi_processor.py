"""Copied into the tiny Kimi-K2.5 checkpoint as its remote-code processor.

SGLang's Kimi-K2.5 support reads `processor.media_processor.media_proc_cfg`,
which the real checkpoint's own remote-code processor has and transformers'
Kimi_K25Processor does not; this adds it, from the image processor's
settings. Served with `--trust-remote-code`, as the real model is.
"""
from transformers.models.kimi_k25.processing_kimi_k25 import Kimi_K25Processor


class _MediaProcessor:
    def __init__(self, image_processor):
        self.media_proc_cfg = {
            "patch_size": image_processor.patch_size,
            "merge_kernel_size": [image_processor.merge_size] * 2,
            "in_patch_limit": image_processor.max_patches,
            "patch_limit_on_one_side": 512,
            "image_mean": list(image_processor.image_mean),
            "image_std": list(image_processor.image_std),
        }


class TinyKimiK25Processor(Kimi_K25Processor):
    def __init__(self, image_processor=None, tokenizer=None, video_processor=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, video_processor, chat_template=chat_template, **kwargs)
        self.media_processor = _MediaProcessor(self.image_processor)
