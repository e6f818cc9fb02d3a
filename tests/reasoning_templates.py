"""Chat templates shaped like the reasoning targets' own, for the tiny
model's tokenizer: how each renders its switch, its generation prompt and
an earlier answer. Written here after the published templates' behaviour
(not copied): Qwen3's (tokenizer_config.json of Qwen/Qwen3-8B) and
Kimi-K2.5's (chat_template.jinja of moonshotai/Kimi-K2.5)."""

# Qwen3: reads `enable_thinking`; thinking is on by default, and off the
# generation prompt closes an empty reasoning part. An assistant turn after
# the last user turn is rendered with its reasoning block, an earlier one
# without: a history does not render as it did when it was the last turn.
QWEN3 = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set content = m.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")

# Kimi-K2.5: reads `thinking` (SGLang's kimi_k2 reasoning parser's switch),
# on by default; off, the generation prompt holds an empty <think></think>.
# Every assistant turn in a history is rendered with an empty reasoning part.
KIMI_K25 = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{{- '<|im_assistant|>assistant<|im_middle|><think></think>' + m.content + '<|im_end|>' }}"
    "{%- else %}{{- '<|im_' + m.role + '|>' + m.role + '<|im_middle|>' + m.content + '<|im_end|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_assistant|>assistant<|im_middle|>' }}"
    "{%- if thinking is defined and thinking is false %}{{- '<think></think>' }}{%- endif %}{%- endif %}")

# A template with no switch at all: thinking settings cannot reach it.
NO_SWITCH = ("{%- for m in messages %}{{- m.role + ': ' + m.content + '\\n' }}{%- endfor %}"
             "{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}")

# Qwen3's handling of agentic turns: an assistant turn's tool_calls as
# <tool_call> blocks, a tool's result as a user turn's <tool_response>, and
# any other role (a "developer" turn) dropped without a word.
QWEN3_TOOLS = (
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or m.role == 'system' %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + (m.content or '') }}"
    "{%- for call in m.tool_calls or [] %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{%- if call.function.arguments is string %}{{- call.function.arguments }}"
    "{%- else %}{{- call.function.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + m.content"
    " + '\\n</tool_response><|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
