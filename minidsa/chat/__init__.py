"""Chat formats per model family: conversations into prompts, and the model's output back into a message.

- `formats.py`: which format a model uses (`select_chat_format`), and `ChatFormat.prepare`: messages + tools +
  options -> prompt tokens, how to parse the answer, and the structured-output constraint it needs.
- `dsv32.py`: DeepSeek-V3.2's own encoding (the model ships no jinja template).
- `template.py`: jinja chat templates (GLM-5's, or --chat-template FILE).
- `parser.py`: the answer parsed back, whole or streamed: reasoning, content, tool calls (DSML, GLM).
- `tools.py`: tools and tool_choice checked; the JSON schema of a forced call; typed parameter values.
- `messages.py`: OpenAI messages checked and normalised once for every format.
- `grammar.py`: structured outputs: a response_format compiled into a grammar (xgrammar), each request's
  `GrammarState`, the token masks of a step.
"""

from minidsa.chat.formats import ChatFormat, ChatOptions, PreparedChat, select_chat_format
from minidsa.chat.grammar import GrammarState, StructuredOutputs, parse_response_format
from minidsa.chat.messages import ChatFormatError
from minidsa.chat.parser import ChatOutputParser, OutputSpec

__all__ = ["ChatFormat", "ChatFormatError", "ChatOptions", "ChatOutputParser", "GrammarState", "OutputSpec",
           "PreparedChat", "StructuredOutputs", "parse_response_format", "select_chat_format"]
