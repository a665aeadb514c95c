"""The chat templates of `runner.demo_families`' models, one per family.

Each is written to the family's published template (gpt-oss, Qwen3-Coder, Devstral Small 2,
GLM-4.7, Kimi-K2-Thinking, MiniMax-M2, LFM2, Gemma 4) and renders the same text for the same
conversation; compact because it drops what no text conversation reaches (images, builtin
tools, checks that only raise). Each holds the markers that mlx-lm's `_infer_tool_parser`
looks for, so mlx-lm picks the tool parser it picks for the real model. Where a family's
template would fail on a tool call whose arguments are a string (a model's malformed call,
sent back as it was), the string is rendered where the arguments go.
"""

# Harmony, as gpt-oss's template writes it: a system message (reasoning level), a developer
# message (instructions, tools as TypeScript), one message per channel. Variables:
# reasoning_effort (low, medium, high; medium by default), model_identity, current_date (the
# real template writes today's date; here only a given one).
HARMONY_TEMPLATE = r"""
{%- macro ts_type(spec) -%}
    {%- if spec.type is defined and spec.type is not string and spec.type is iterable -%}
        {{- spec.type | join(' | ') }}
    {%- elif spec.oneOf is defined and spec.oneOf -%}
        {%- for variant in spec.oneOf -%}
            {{- ts_type(variant) + (' | ' if not loop.last else '') }}
        {%- endfor -%}
    {%- elif spec.type == 'array' -%}
        {%- set inner = ts_type(spec['items']) if spec['items'] is mapping else 'any' -%}
        {{- (inner if inner | length <= 50 else 'any') + '[]' }}
        {{- ' | null' if spec.nullable else '' }}
    {%- elif spec.type == 'string' and spec.enum -%}
        {{- '"' + spec.enum | join('" | "') + '"' }}
    {%- elif spec.type == 'string' -%}
        {{- 'string' + (' | null' if spec.nullable else '') }}
    {%- elif spec.type in ['number', 'integer'] -%}
        {{- 'number' }}
    {%- elif spec.type == 'boolean' -%}
        {{- 'boolean' }}
    {%- elif spec.type == 'object' and spec.properties -%}
        {{- '{\n' }}
        {%- for name, prop in spec.properties.items() -%}
            {{- name + ('' if name in (spec.required or []) else '?') + ': ' + ts_type(prop) }}
            {{- ', ' if not loop.last else '' }}
        {%- endfor -%}
        {{- '}' }}
    {%- elif spec.type == 'object' -%}
        {{- 'object' }}
    {%- else -%}
        {{- 'any' }}
    {%- endif -%}
{%- endmacro -%}
{%- macro tool_namespace(tools) -%}
    {{- '## functions\n\nnamespace functions {\n\n' }}
    {%- for tool in tools -%}
        {%- set tool = tool.function if tool.function is defined else tool -%}
        {%- if tool.description -%}
            {{- '// ' + tool.description + '\n' }}
        {%- endif -%}
        {{- 'type ' + tool.name + ' = ' }}
        {%- set params = tool.parameters if tool.parameters is mapping else {} -%}
        {%- if params.properties -%}
            {{- '(_: {\n' }}
            {%- for name, spec in params.properties.items() -%}
                {%- if spec.description -%}
                    {{- '// ' + spec.description + '\n' }}
                {%- endif -%}
                {{- name + ('' if name in (params.required or []) else '?') + ': ' }}
                {{- ts_type(spec) }}
                {%- if spec.default is defined -%}
                    {{- ', // default: ' }}
                    {{- spec.default | string if spec.enum else spec.default | tojson }}
                {%- endif -%}
                {{- ',\n' }}
            {%- endfor -%}
            {{- '}) => any;\n\n' }}
        {%- else -%}
            {{- '() => any;\n\n' }}
        {%- endif -%}
    {%- endfor -%}
    {{- '} // namespace functions' }}
{%- endmacro -%}
{{- '<|start|>system<|message|>' }}
{{- model_identity if model_identity is defined and model_identity
    else 'You are ChatGPT, a large language model trained by OpenAI.' }}
{{- '\nKnowledge cutoff: 2024-06\n' }}
{%- if current_date is defined and current_date -%}
    {{- 'Current date: ' + current_date + '\n' }}
{%- endif -%}
{{- '\nReasoning: ' }}
{{- reasoning_effort if reasoning_effort is defined and reasoning_effort else 'medium' }}
{{- '\n\n# Valid channels: analysis, commentary, final. Channel must be included for every '
    'message.' }}
{%- if tools -%}
    {{- "\nCalls to these tools must go to the commentary channel: 'functions'." }}
{%- endif -%}
{{- '<|end|>' }}
{%- if messages and messages[0].role in ['system', 'developer'] -%}
    {%- set developer_message = messages[0].content -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set developer_message = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- if developer_message or tools -%}
    {{- '<|start|>developer<|message|>' }}
    {%- if developer_message -%}
        {{- '# Instructions\n\n' + developer_message + '\n\n' }}
    {%- endif -%}
    {%- if tools -%}
        {{- '# Tools\n\n' + tool_namespace(tools) }}
    {%- endif -%}
    {{- '<|end|>' }}
{%- endif -%}
{%- set ns = namespace(calls=[], results=0) -%}
{%- for message in loop_messages -%}
    {%- if message.role == 'assistant' and message.tool_calls -%}
        {#- A tool call's reasoning stays until a final answer follows it. -#}
        {%- set later = namespace(final=false) -%}
        {%- for future in loop_messages[loop.index:] -%}
            {%- if future.role == 'assistant' and not future.tool_calls -%}
                {%- set later.final = true -%}
            {%- endif -%}
        {%- endfor -%}
        {%- set analysis = message.thinking or message.reasoning_content or message.content -%}
        {%- if analysis and not later.final -%}
            {{- '<|start|>assistant<|channel|>analysis<|message|>' + analysis + '<|end|>' }}
        {%- endif -%}
        {%- set ns.calls = [] -%}
        {%- set ns.results = 0 -%}
        {%- for call in message.tool_calls -%}
            {%- set call = call.function if call.function is defined else call -%}
            {{- '<|start|>assistant to=functions.' + call.name }}
            {{- '<|channel|>commentary json<|message|>' }}
            {{- call.arguments if call.arguments is string else call.arguments | tojson }}
            {{- '<|call|>' }}
            {%- set ns.calls = ns.calls + [call.name] -%}
        {%- endfor -%}
    {%- elif message.role == 'assistant' -%}
        {%- set thinking = message.thinking or message.reasoning_content -%}
        {%- if loop.last and not add_generation_prompt and thinking -%}
            {{- '<|start|>assistant<|channel|>analysis<|message|>' + thinking + '<|end|>' }}
        {%- endif -%}
        {{- '<|start|>assistant<|channel|>final<|message|>' + (message.content or '') }}
        {{- '<|return|>' if loop.last and not add_generation_prompt else '<|end|>' }}
        {%- set ns.calls = [] -%}
    {%- elif message.role == 'tool' -%}
        {%- if message.name -%}
            {%- set name = message.name -%}
        {%- elif ns.calls -%}
            {%- set name = ns.calls[ns.results] if ns.results < ns.calls | length
                else ns.calls[-1] -%}
        {%- else -%}
            {{- raise_exception('A tool message must follow an assistant message with tool '
                'calls.') }}
        {%- endif -%}
        {{- '<|start|>functions.' + name + ' to=assistant<|channel|>commentary<|message|>' }}
        {{- message.content + '<|end|>' }}
        {%- set ns.results = ns.results + 1 -%}
    {%- elif message.role == 'user' -%}
        {{- '<|start|>user<|message|>' + message.content + '<|end|>' }}
    {%- elif message.role in ['system', 'developer'] -%}
        {{- '<|start|>developer<|message|># Instructions\n\n' + message.content + '\n\n<|end|>' }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|start|>assistant' }}
{%- endif -%}
""".strip()

# Qwen3-Coder-30B-A3B-Instruct's: ChatML, tools as XML in the system turn, calls as
# <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>.
QWEN3_CODER_TEMPLATE = r"""
{%- macro extra_keys(fields, handled) -%}
    {%- if fields is mapping -%}
        {%- for key in fields if key not in handled -%}
            {%- set value = fields[key] -%}
            {{- '\n<' + key + '>' }}
            {{- value | tojson if value is mapping or (value is sequence and value is not string)
                else value | string }}
            {{- '</' + key + '>' }}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if messages and messages[0].role == 'system' -%}
    {%- set system_message = messages[0].content -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- if system_message is defined -%}
    {{- '<|im_start|>system\n' + system_message }}
{%- elif tools -%}
    {{- '<|im_start|>system\nYou are Qwen, a helpful AI assistant that can interact with a '
        'computer to solve tasks.' }}
{%- endif -%}
{%- if tools -%}
    {{- '\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>' }}
    {%- for tool in tools -%}
        {%- set tool = tool.function if tool.function is defined else tool -%}
        {{- '\n<function>\n<name>' + tool.name + '</name>' }}
        {%- if tool.description is defined -%}
            {{- '\n<description>' + tool.description | trim + '</description>' }}
        {%- endif -%}
        {{- '\n<parameters>' }}
        {%- if tool.parameters is mapping and tool.parameters.properties is mapping -%}
            {%- for name, fields in tool.parameters.properties | items -%}
                {{- '\n<parameter>\n<name>' + name + '</name>' }}
                {%- if fields.type is defined -%}
                    {{- '\n<type>' + fields.type | string + '</type>' }}
                {%- endif -%}
                {%- if fields.description is defined -%}
                    {{- '\n<description>' + fields.description | trim + '</description>' }}
                {%- endif -%}
                {{- extra_keys(fields, ['name', 'type', 'description']) }}
                {{- '\n</parameter>' }}
            {%- endfor -%}
        {%- endif -%}
        {{- extra_keys(tool.parameters, ['type', 'properties']) }}
        {{- '\n</parameters>' }}
        {{- extra_keys(tool, ['type', 'name', 'description', 'parameters']) }}
        {{- '\n</function>' }}
    {%- endfor -%}
    {{- '\n</tools>' }}
    {{- '\n\nIf you choose to call a function ONLY reply in the following format with NO '
        'suffix:\n\n<tool_call>\n<function=example_function_name>\n'
        '<parameter=example_parameter_1>\nvalue_1\n</parameter>\n'
        '<parameter=example_parameter_2>\nThis is the value for the second parameter\n'
        'that can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n'
        '<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner '
        '<function=...></function> block must be nested within <tool_call></tool_call> XML '
        'tags\n- Required parameters MUST be specified\n- You may provide optional reasoning '
        'for your function call in natural language BEFORE the function call, but NOT after\n'
        '- If there is no function call available, answer the question like normal with your '
        'current knowledge and do not tell the user about function calls\n</IMPORTANT>' }}
{%- endif -%}
{%- if system_message is defined or tools -%}
    {{- '<|im_end|>\n' }}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if message.role == 'assistant' and message.tool_calls -%}
        {{- '<|im_start|>assistant' }}
        {%- if message.content is string and message.content | trim -%}
            {{- '\n' + message.content | trim + '\n' }}
        {%- endif -%}
        {%- for tool_call in message.tool_calls -%}
            {%- set tool_call = tool_call.function if tool_call.function is defined
                else tool_call -%}
            {{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
            {%- if tool_call.arguments is mapping -%}
                {%- for name, value in tool_call.arguments | items -%}
                    {{- '<parameter=' + name + '>\n' }}
                    {{- value | tojson
                        if value is mapping or (value is sequence and value is not string)
                        else value | string }}
                    {{- '\n</parameter>\n' }}
                {%- endfor -%}
            {%- elif tool_call.arguments -%}
                {{- tool_call.arguments + '\n' }}
            {%- endif -%}
            {{- '</function>\n</tool_call>' }}
        {%- endfor -%}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}
            {{- '<|im_start|>user\n' }}
        {%- endif -%}
        {{- '<tool_response>\n' + message.content + '\n</tool_response>\n' }}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}
            {{- '<|im_end|>\n' }}
        {%- endif -%}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>\n' }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' }}
{%- endif -%}
""".strip()

# Devstral Small 2's: the system prompt and the tools up front, calls as
# [TOOL_CALLS]NAME[ARGS]{json}, each assistant message closed by </s>. The real template's
# default system prompt (which holds today's and yesterday's date) is left out.
MISTRAL_TEMPLATE = r"""
{{- bos_token }}
{%- if messages and messages[0].role == 'system' -%}
    {{- '[SYSTEM_PROMPT]' + messages[0].content + '[/SYSTEM_PROMPT]' }}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- if tools -%}
    {{- '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if message.role == 'system' -%}
        {{- '[SYSTEM_PROMPT]' + message.content + '[/SYSTEM_PROMPT]' }}
    {%- elif message.role == 'user' -%}
        {{- '[INST]' + message.content + '[/INST]' }}
    {%- elif message.role == 'assistant' -%}
        {{- message.content or '' }}
        {%- for tool_call in message.tool_calls or [] -%}
            {%- set function = tool_call.function if tool_call.function is defined
                else tool_call -%}
            {{- '[TOOL_CALLS]' + function.name + '[ARGS]' }}
            {{- (function.arguments or '{}') if function.arguments is string
                else function.arguments | tojson }}
        {%- endfor -%}
        {{- eos_token }}
    {%- elif message.role == 'tool' -%}
        {{- '[TOOL_RESULTS]' + message.content | string + '[/TOOL_RESULTS]' }}
    {%- else -%}
        {{- raise_exception('Only user, assistant, tool and system roles are supported, got '
            + message.role + '.') }}
    {%- endif -%}
{%- endfor -%}
""".strip()

# GLM-4.7's: [gMASK]<sop>, tools in a system turn, calls as
# <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call>, results after
# <|observation|>; the reasoning of the turns after the last user message is kept (all of it
# with clear_thinking=false), and the generation prompt opens <think> unless enable_thinking
# is false.
GLM47_TEMPLATE = r"""
{{- '[gMASK]<sop>' }}
{%- if tools -%}
    {{- '<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user '
        'query.\n\nYou are provided with function signatures within <tools></tools> XML '
        'tags:\n<tools>\n' }}
    {%- for tool in tools -%}
        {{- tool | tojson + '\n' }}
    {%- endfor -%}
    {{- '</tools>\n\nFor each function call, output the function name and arguments within '
        'the following XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key>'
        '<arg_value>{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key>'
        '<arg_value>{arg-value-2}</arg_value>...</tool_call>' }}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
    {%- if m.role == 'user' -%}
        {%- set ns.last_user = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
    {%- if m.role == 'user' -%}
        {{- '<|user|>' + m.content }}
    {%- elif m.role == 'assistant' -%}
        {{- '<|assistant|>' }}
        {%- set content = m.content or '' -%}
        {%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}
        {%- if m.reasoning_content is not string and '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1]
                .lstrip('\n') -%}
            {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
        {%- endif -%}
        {%- if ((clear_thinking is defined and not clear_thinking)
                or loop.index0 > ns.last_user) and reasoning -%}
            {{- '<think>' + reasoning.strip() + '</think>' }}
        {%- else -%}
            {{- '</think>' }}
        {%- endif -%}
        {{- content.strip() }}
        {%- for tc in m.tool_calls or [] -%}
            {%- set tc = tc.function if tc.function is defined else tc -%}
            {{- '<tool_call>' + tc.name }}
            {%- if tc.arguments is mapping -%}
                {%- for k, v in tc.arguments.items() -%}
                    {{- '<arg_key>' + k + '</arg_key><arg_value>' }}
                    {{- v if v is string else v | tojson }}
                    {{- '</arg_value>' }}
                {%- endfor -%}
            {%- elif tc.arguments -%}
                {{- tc.arguments }}
            {%- endif -%}
            {{- '</tool_call>' }}
        {%- endfor -%}
    {%- elif m.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}
            {{- '<|observation|>' }}
        {%- endif -%}
        {{- '<tool_response>' + m.content + '</tool_response>' }}
    {%- elif m.role == 'system' -%}
        {{- '<|system|>' + m.content }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|assistant|>' }}
    {{- '</think>' if enable_thinking is defined and not enable_thinking else '<think>' }}
{%- endif -%}
""".strip()

# Kimi-K2-Thinking's: tools declared in a system message, calls as
# <|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>{json}<|tool_call_end|> in a
# section, results as "## Return of ID"; reasoning kept after the last plain assistant answer.
# A call id not in the functions.NAME:N form is rendered in it (N: its place in the message),
# in the call and in its result, so that the history parses as Kimi's calls do.
KIMI_TEMPLATE = r"""
{%- macro call_id(call, index) -%}
    {%- if call.id is defined and call.id and call.id.startswith('functions.') -%}
        {{- call.id }}
    {%- else -%}
        {{- 'functions.' + (call.function.name if call.function is defined else call.name) }}
        {{- ':' + index | string }}
    {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_plain=-1) -%}
{%- for m in messages -%}
    {%- if m.role == 'assistant' and not m.tool_calls -%}
        {%- set ns.last_plain = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{%- if tools -%}
    {{- '<|im_system|>tool_declare<|im_middle|>' + tools | tojson + '<|im_end|>' }}
{%- endif -%}
{%- if not messages or messages[0].role != 'system' -%}
    {{- '<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot '
        'AI.<|im_end|>' }}
{%- endif -%}
{%- for m in messages -%}
    {%- set role_name = m.name or m.role -%}
    {%- if m.role == 'user' -%}
        {{- '<|im_user|>' + role_name + '<|im_middle|>' }}
    {%- elif m.role == 'assistant' -%}
        {{- '<|im_assistant|>' + role_name + '<|im_middle|>' }}
    {%- else -%}
        {{- '<|im_system|>' + role_name + '<|im_middle|>' }}
    {%- endif -%}
    {%- if m.role == 'assistant' -%}
        {{- '<think>' + ((m.reasoning_content or '') if loop.index0 > ns.last_plain else '') }}
        {{- '</think>' + (m.content or '') }}
        {%- if m.tool_calls -%}
            {{- '<|tool_calls_section_begin|>' }}
            {%- for call in m.tool_calls -%}
                {%- set arguments = call.function.arguments if call.function is defined
                    else call.arguments -%}
                {{- '<|tool_call_begin|>' + call_id(call, loop.index0) }}
                {{- '<|tool_call_argument_begin|>' }}
                {{- arguments if arguments is string else arguments | tojson }}
                {{- '<|tool_call_end|>' }}
            {%- endfor -%}
            {{- '<|tool_calls_section_end|>' }}
        {%- endif -%}
    {%- elif m.role == 'tool' -%}
        {%- set found = namespace(id=m.tool_call_id or '') -%}
        {%- if not found.id.startswith('functions.') -%}
            {%- for j in range(loop.index0 - 1, -1, -1) -%}
                {%- if messages[j].role == 'assistant' and found.id == (m.tool_call_id or '') -%}
                    {%- for call in messages[j].tool_calls or [] -%}
                        {%- if call.id == m.tool_call_id -%}
                            {%- set found.id = call_id(call, loop.index0) -%}
                        {%- endif -%}
                    {%- endfor -%}
                {%- endif -%}
            {%- endfor -%}
        {%- endif -%}
        {{- '## Return of ' + found.id + '\n' + (m.content or '') }}
    {%- elif m.content is not none -%}
        {{- m.content }}
    {%- endif -%}
    {{- '<|im_end|>' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_assistant|>assistant<|im_middle|>' }}
{%- endif -%}
""".strip()

# MiniMax-M2's: ]~!b[ then turns ]~b]ROLE\n...[e~[\n, tools as JSON in <tools>, calls as
# <minimax:tool_call>\n<invoke name="NAME">\n<parameter name="KEY">VALUE</parameter>\n</invoke>
# \n</minimax:tool_call>, results as <response> in a tool turn; reasoning of the turns after the
# last user message kept, and the generation prompt opens <think> (closes it too with
# enable_thinking=false, as MiniMax's later M2.x templates do).
MINIMAX_TEMPLATE = r"""
{%- if messages and messages[0].role == 'system' -%}
    {%- set system_message = messages[0] -%}
    {%- set conversation = messages[1:] -%}
{%- else -%}
    {%- set system_message = none -%}
    {%- set conversation = messages -%}
{%- endif -%}
{%- set ns = namespace(last_user=-1, last_call=none) -%}
{%- for m in conversation -%}
    {%- if m.role == 'user' -%}
        {%- set ns.last_user = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{{- ']~!b[]~b]system\n' }}
{%- if system_message and system_message.content -%}
    {{- system_message.content }}
{%- else -%}
    {{- model_identity if model_identity is defined else 'You are a helpful assistant.' }}
{%- endif -%}
{%- if system_message and system_message.current_date -%}
    {{- '\nCurrent date: ' + system_message.current_date }}
{%- endif -%}
{%- if system_message and system_message.current_location -%}
    {{- '\nCurrent location: ' + system_message.current_location }}
{%- endif -%}
{%- if tools -%}
    {{- '\n\n# Tools\nYou may call one or more tools to assist with the user query.\nHere are '
        'the tools available in JSONSchema format:\n\n<tools>\n' }}
    {%- for tool in tools -%}
        {{- '<tool>' + tool.function | tojson + '</tool>\n' }}
    {%- endfor -%}
    {{- '</tools>\n\nWhen making tool calls, use XML format to invoke tools and pass '
        'parameters:\n\n<minimax:tool_call>\n<invoke name="tool-name-1">\n'
        '<parameter name="param-key-1">param-value-1</parameter>\n'
        '<parameter name="param-key-2">param-value-2</parameter>\n...\n</invoke>\n'
        '</minimax:tool_call>' }}
{%- endif -%}
{{- '[e~[\n' }}
{%- for message in conversation -%}
    {%- if message.role == 'assistant' -%}
        {{- ']~b]ai\n' }}
        {%- set content = message.content or '' -%}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string
            else '' -%}
        {%- if message.reasoning_content is not string and '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].strip('\n').split('<think>')[-1]
                .strip('\n') -%}
            {%- set content = content.split('</think>')[-1].strip('\n') -%}
        {%- endif -%}
        {%- if reasoning and loop.index0 > ns.last_user -%}
            {{- '<think>\n' + reasoning + '\n</think>\n\n' }}
        {%- endif -%}
        {{- content }}
        {%- if message.tool_calls -%}
            {{- '\n<minimax:tool_call>\n' }}
            {%- for tool_call in message.tool_calls -%}
                {%- set tool_call = tool_call.function if tool_call.function is defined
                    else tool_call -%}
                {{- '<invoke name="' + tool_call.name + '">\n' }}
                {%- if tool_call.arguments is mapping -%}
                    {%- for k, v in tool_call.arguments | items -%}
                        {{- '<parameter name="' + k + '">' }}
                        {{- v if v is string else v | tojson }}
                        {{- '</parameter>\n' }}
                    {%- endfor -%}
                {%- elif tool_call.arguments -%}
                    {{- tool_call.arguments + '\n' }}
                {%- endif -%}
                {{- '</invoke>\n' }}
                {%- set ns.last_call = tool_call.name -%}
            {%- endfor -%}
            {{- '</minimax:tool_call>' }}
        {%- else -%}
            {%- set ns.last_call = none -%}
        {%- endif -%}
        {{- '[e~[\n' }}
    {%- elif message.role == 'tool' -%}
        {%- if ns.last_call is none -%}
            {{- raise_exception('Message has tool role, but there was no previous assistant '
                'message with a tool call!') }}
        {%- endif -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}
            {{- ']~b]tool' }}
        {%- endif -%}
        {{- '\n<response>' + message.content + '</response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}
            {{- '[e~[\n' }}
        {%- endif -%}
    {%- elif message.role == 'user' -%}
        {{- ']~b]user\n' + message.content + '[e~[\n' }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- ']~b]ai\n<think>\n' }}
    {%- if enable_thinking is defined and not enable_thinking -%}
        {{- '</think>\n\n' }}
    {%- endif -%}
{%- endif -%}
""".strip()

# LFM2's: ChatML after <|startoftext|>, the tools as a JSON list between <|tool_list_start|>
# and <|tool_list_end|> in the system turn, results between <|tool_response_start|> and
# <|tool_response_end|>. LFM2's own template renders no tool_calls (clients put the call text
# in the content); here they are written as LFM2 writes them,
# <|tool_call_start|>[name(key=value, ...)]<|tool_call_end|> (values in JSON), after the
# content, as LFM2.5's template places them.
LFM2_TEMPLATE = r"""
{{- bos_token }}
{%- set ns = namespace(system='') -%}
{%- if messages and messages[0].role == 'system' -%}
    {%- set ns.system = messages[0].content -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- if tools -%}
    {%- set ns.system = ns.system + ('\n' if ns.system else '')
        + 'List of tools: <|tool_list_start|>[' -%}
    {%- for tool in tools -%}
        {%- set ns.system = ns.system + (tool if tool is string else tool | tojson)
            + (', ' if not loop.last else '') -%}
    {%- endfor -%}
    {%- set ns.system = ns.system + ']<|tool_list_end|>' -%}
{%- endif -%}
{%- if ns.system -%}
    {{- '<|im_start|>system\n' + ns.system + '<|im_end|>\n' }}
{%- endif -%}
{%- for message in loop_messages -%}
    {{- '<|im_start|>' + message.role + '\n' }}
    {%- if message.content is string -%}
        {%- set content = message.content -%}
    {%- else -%}
        {%- set content = message.content | tojson if message.content else '' -%}
    {%- endif -%}
    {%- if message.role == 'tool' -%}
        {{- '<|tool_response_start|>' + content + '<|tool_response_end|>' }}
    {%- else -%}
        {{- content }}
    {%- endif -%}
    {%- if message.role == 'assistant' and message.tool_calls -%}
        {{- '<|tool_call_start|>[' }}
        {%- for call in message.tool_calls -%}
            {%- set call = call.function if call.function is defined else call -%}
            {{- call.name + '(' }}
            {%- if call.arguments is mapping -%}
                {%- for key, value in call.arguments.items() -%}
                    {{- key + '=' + value | tojson + (', ' if not loop.last else '') }}
                {%- endfor -%}
            {%- else -%}
                {{- call.arguments or '' }}
            {%- endif -%}
            {{- ')' + (', ' if not loop.last else '') }}
        {%- endfor -%}
        {{- ']<|tool_call_end|>' }}
    {%- endif -%}
    {{- '<|im_end|>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' }}
{%- endif -%}
""".strip()

# Gemma 4's: turns <|turn>ROLE\n...<turn|>\n (the assistant's role is "model"), tools declared
# in the system turn in Gemma's own notation (strings between <|"|>), calls as
# <|tool_call>call:NAME{key:value}<tool_call|>, each followed in the same model turn by the
# results of the tool messages after it (<|tool_response>response:NAME{value:...}
# <tool_response|>); <|think|> in the system turn with enable_thinking, else an empty thought
# channel opens the answer.
GEMMA4_TEMPLATE = r"""
{%- macro format_argument(argument, escape_keys=True) -%}
    {%- if argument is string -%}
        {{- '<|"|>' + argument + '<|"|>' }}
    {%- elif argument is boolean -%}
        {{- 'true' if argument else 'false' }}
    {%- elif argument is mapping -%}
        {{- '{' }}
        {%- for key, value in argument | dictsort -%}
            {{- ('<|"|>' + key + '<|"|>' if escape_keys else key) + ':' }}
            {{- format_argument(value, escape_keys=escape_keys) + (',' if not loop.last else '') }}
        {%- endfor -%}
        {{- '}' }}
    {%- elif argument is sequence -%}
        {{- '[' }}
        {%- for item in argument -%}
            {{- format_argument(item, escape_keys=escape_keys) + (',' if not loop.last else '') }}
        {%- endfor -%}
        {{- ']' }}
    {%- else -%}
        {{- argument }}
    {%- endif -%}
{%- endmacro -%}
{%- macro quoted_list(items) -%}
    {%- for item in items -%}
        {{- '<|"|>' + item + '<|"|>' + (',' if not loop.last else '') }}
    {%- endfor -%}
{%- endmacro -%}
{%- macro format_parameters(properties) -%}
    {%- set listed = namespace(any=false) -%}
    {%- for key, value in properties | dictsort -%}
        {%- if key not in ['description', 'type', 'properties', 'required', 'nullable'] -%}
            {{- (',' if listed.any else '') + key + ':{' }}
            {%- set listed.any = true -%}
            {%- set comma = namespace(due=false) -%}
            {%- if value.description -%}
                {{- 'description:<|"|>' + value.description + '<|"|>' }}
                {%- set comma.due = true -%}
            {%- endif -%}
            {%- if value.nullable -%}
                {{- (',' if comma.due else '') + 'nullable:true' }}
                {%- set comma.due = true -%}
            {%- endif -%}
            {%- set value_type = value.type if value.type is string else value.type[0] -%}
            {%- if value_type | upper == 'STRING' and value.enum -%}
                {{- (',' if comma.due else '') + 'enum:' + format_argument(value.enum) }}
                {%- set comma.due = true -%}
            {%- elif value_type | upper == 'OBJECT' -%}
                {{- ',properties:{' }}
                {{- format_parameters(value.properties if value.properties is mapping
                    else value) }}
                {{- '}' }}
                {%- if value.required -%}
                    {{- ',required:[' + quoted_list(value.required) + ']' }}
                {%- endif -%}
            {%- elif value_type | upper == 'ARRAY' and value['items'] is mapping
                and value['items'] -%}
                {{- ',items:{' }}
                {%- set inner = namespace(any=false) -%}
                {%- for item_key, item_value in value['items'] | dictsort -%}
                    {%- if item_value is not none -%}
                        {{- ',' if inner.any else '' }}
                        {%- set inner.any = true -%}
                        {%- if item_key == 'properties' -%}
                            {{- 'properties:{' }}
                            {{- format_parameters(item_value) if item_value is mapping else '' }}
                            {{- '}' }}
                        {%- elif item_key == 'required' -%}
                            {{- 'required:[' + quoted_list(item_value) + ']' }}
                        {%- elif item_key == 'type' -%}
                            {{- 'type:' + format_argument(item_value | upper
                                if item_value is string else item_value | map('upper') | list) }}
                        {%- else -%}
                            {{- item_key + ':' + format_argument(item_value) }}
                        {%- endif -%}
                    {%- endif -%}
                {%- endfor -%}
                {{- '}' }}
            {%- endif -%}
            {{- (',' if comma.due else '') + 'type:<|"|>' + value_type | upper + '<|"|>}' }}
        {%- endif -%}
    {%- endfor -%}
{%- endmacro -%}
{%- macro format_function_declaration(tool) -%}
    {%- set function = tool.function -%}
    {{- 'declaration:' + function.name + '{description:<|"|>' }}
    {{- function.description | default('') + '<|"|>' }}
    {%- set params = function.parameters -%}
    {%- if params -%}
        {{- ',parameters:{' }}
        {%- if params.properties -%}
            {{- 'properties:{' + format_parameters(params.properties) + '},' }}
        {%- endif -%}
        {%- if params.required -%}
            {{- 'required:[' + quoted_list(params.required) + '],' }}
        {%- endif -%}
        {%- if params.type -%}
            {{- 'type:<|"|>' + params.type | upper + '<|"|>}' }}
        {%- endif -%}
    {%- endif -%}
    {%- if 'response' in function -%}
        {%- set response = function.response -%}
        {{- ',response:{' }}
        {%- if response.description -%}
            {{- 'description:<|"|>' + response.description + '<|"|>,' }}
        {%- endif -%}
        {%- if response.type | upper == 'OBJECT' -%}
            {{- 'type:<|"|>' + response.type | upper + '<|"|>}' }}
        {%- endif -%}
    {%- endif -%}
    {{- '}' }}
{%- endmacro -%}
{%- macro strip_thinking(text) -%}
    {%- set kept = namespace(text='') -%}
    {%- for part in text.split('<channel|>') -%}
        {%- set kept.text = kept.text
            + (part.split('<|channel>')[0] if '<|channel>' in part else part) -%}
    {%- endfor -%}
    {{- kept.text | trim }}
{%- endmacro -%}
{%- macro format_tool_response(name, response) -%}
    {{- '<|tool_response>response:' + name + '{' }}
    {%- if response is mapping -%}
        {%- for key, value in response | dictsort -%}
            {{- key + ':' + format_argument(value, escape_keys=False) }}
            {{- ',' if not loop.last else '' }}
        {%- endfor -%}
    {%- else -%}
        {{- 'value:' + format_argument(response, escape_keys=False) }}
    {%- endif -%}
    {{- '}<tool_response|>' }}
{%- endmacro -%}
{%- set ns = namespace(prev=none) -%}
{%- set loop_messages = messages -%}
{{- bos_token }}
{%- set thinking_on = enable_thinking is defined and enable_thinking -%}
{%- set has_system = messages and messages[0].role in ['system', 'developer'] -%}
{%- if thinking_on or tools or has_system -%}
    {{- '<|turn>system\n' }}
    {%- if thinking_on -%}
        {{- '<|think|>\n' }}
        {%- set ns.prev = 'think' -%}
    {%- endif -%}
    {%- if has_system -%}
        {{- messages[0].content | trim }}
        {%- set loop_messages = messages[1:] -%}
    {%- endif -%}
    {%- for tool in tools or [] -%}
        {{- '<|tool>' + format_function_declaration(tool) | trim + '<tool|>' }}
        {%- set ns.prev = 'tool' -%}
    {%- endfor -%}
    {{- '<turn|>\n' }}
{%- endif -%}
{%- set turn = namespace(last_user=-1) -%}
{%- for message in loop_messages -%}
    {%- if message.role == 'user' -%}
        {%- set turn.last_user = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{%- for message in loop_messages -%}
    {%- if message.role != 'tool' -%}
        {%- set ns.prev = none -%}
        {%- set role = 'model' if message.role == 'assistant' else message.role -%}
        {#- An assistant message right after another (tool results between) continues its turn. -#}
        {%- set before = namespace(role=none) -%}
        {%- for j in range(loop.index0) -%}
            {%- if loop_messages[j].role != 'tool' -%}
                {%- set before.role = loop_messages[j].role -%}
            {%- endif -%}
        {%- endfor -%}
        {%- if not (role == 'model' and before.role == 'assistant') -%}
            {{- '<|turn>' + role + '\n' }}
        {%- endif -%}
        {%- set thinking = message.reasoning or message.reasoning_content -%}
        {%- if thinking and loop.index0 > turn.last_user and message.tool_calls -%}
            {{- '<|channel>thought\n' + thinking + '\n<channel|>' }}
        {%- endif -%}
        {%- for tool_call in message.tool_calls or [] -%}
            {%- set function = tool_call.function if tool_call.function is defined
                else tool_call -%}
            {{- '<|tool_call>call:' + function.name + '{' }}
            {%- if function.arguments is mapping -%}
                {%- for key, value in function.arguments | dictsort -%}
                    {{- key + ':' + format_argument(value, escape_keys=False) }}
                    {{- ',' if not loop.last else '' }}
                {%- endfor -%}
            {%- elif function.arguments is string -%}
                {{- function.arguments }}
            {%- endif -%}
            {{- '}<tool_call|>' }}
            {%- set ns.prev = 'tool_call' -%}
        {%- endfor -%}
        {%- set responses = namespace(any=false, done=false) -%}
        {%- if message.tool_calls -%}
            {%- for k in range(loop.index0 + 1, loop_messages | length) -%}
                {%- if loop_messages[k].role != 'tool' -%}
                    {%- set responses.done = true -%}
                {%- elif not responses.done -%}
                    {%- set follow = loop_messages[k] -%}
                    {%- set tool = namespace(name=follow.name or 'unknown') -%}
                    {%- for call in message.tool_calls -%}
                        {%- if call.id == follow.tool_call_id -%}
                            {%- set tool.name = call.function.name -%}
                        {%- endif -%}
                    {%- endfor -%}
                    {{- format_tool_response(tool.name, follow.content) }}
                    {%- set responses.any = true -%}
                    {%- set ns.prev = 'tool_response' -%}
                {%- endif -%}
            {%- endfor -%}
        {%- endif -%}
        {%- if message.content is not string -%}
            {%- set content = '' -%}
        {%- elif role == 'model' -%}
            {%- set content = strip_thinking(message.content) -%}
        {%- else -%}
            {%- set content = message.content | trim -%}
        {%- endif -%}
        {{- content }}
        {%- if ns.prev == 'tool_call' and not responses.any -%}
            {{- '<|tool_response>' }}
        {%- elif not (responses.any and not content | trim) -%}
            {{- '<turn|>\n' }}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and ns.prev not in ['tool_response', 'tool_call'] -%}
    {{- '<|turn>model\n' }}
    {%- if not thinking_on -%}
        {{- '<|channel>thought\n<channel|>' }}
    {%- endif -%}
{%- endif -%}
""".strip()
