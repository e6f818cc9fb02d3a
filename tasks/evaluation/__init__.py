"""The drafter served: EAGLE-3 speculative decoding in SGLang, checked
against plain greedy decoding."""
