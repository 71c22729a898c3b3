"""Every tool-call format the worker reads, under vLLM's TOOL_CALL_PARSER names (the first name of each is the
one the start-up log reports), with the families that write it."""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from re import escape as regex_escape

from ..output_scan import Scan
from . import forced
from .base import ToolParser
from .json_formats import (HarmonyToolParser, HermesParser, LFM2Parser, Llama3JsonParser, MistralParser,
                           PythonicParser, XLamParser, tagged_json)
from .markup import (MINIMAX_NS, FunctionGemmaNotation, GemmaNotation, Markup, MarkupParser, Params,
                     function_gemma_arguments, gemma_arguments, markup_parser, minimax_m3_rule,
                     minimax_m3_value)

_NAME = r"(?P<name>[\w.\-]+)"


class KimiK2Parser(MarkupParser):
    """Kimi-K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>
    {json}<|tool_call_end|>...<|tool_calls_section_end|>`. Call ids are `functions.NAME:INDEX`, as the model
    writes them and its template expects them back."""
    needs_special_tokens = True
    spec = Markup(
        section=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
        head=r"\s*<\|tool_call_begin\|>\s*(?:functions\.)?(?P<name>[\w.\-]+?):(?P<index>\d+)\s*"
             r"<\|tool_call_argument_begin\|>",
        marker="<|tool_call_begin|>", close="<|tool_call_end|>",
        write="<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>{args}<|tool_call_end|>")


_QWEN3_XML = dict(head=r"\s*<function=(?P<name>[^>\n]+)>", marker="<function=",
                  params=Params(r"<parameter=(?P<key>[^>\n]+)>", "</parameter>"), close="</function>",
                  write="\n<function={name}>\n{args}</function>\n", one_per_section=True)
_DSML_PARAMS = dict(head=r'\s*<｜DSML｜invoke name="(?P<name>[^"]+)">', marker="<｜DSML｜invoke",
                    params=Params(r'<｜DSML｜parameter name="(?P<key>[^"]+)"(?: string="(?P<string>true|false)")?>',
                                  "</｜DSML｜parameter>"), close="</｜DSML｜invoke>",
                    write='\n<｜DSML｜invoke name="{name}">\n{args}</｜DSML｜invoke>',
                    write_param='<｜DSML｜parameter name="{key}" string="{string}">{value}</｜DSML｜parameter>\n')
_DEEPSEEK_SECTION = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
_GLM = dict(head=r"\s*" + _NAME + r"\s*(?=<arg_key>|$)", marker="",
            params=Params(r"<arg_key>(?P<key>[^<]*)</arg_key>\s*<arg_value>", "</arg_value>"),
            write="{name}\n{args}", write_param="<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n",
            one_per_section=True)

Qwen3XmlParser = markup_parser(Markup(section=("<tool_call>", "</tool_call>"), **_QWEN3_XML,
                                      write_param="<parameter={key}>\n{value}\n</parameter>\n"),
                               "Qwen3-Coder, Qwen3.5: `<tool_call><function=NAME><parameter=KEY>value</parameter>"
                               "</function></tool_call>`.")
SeedOssParser = markup_parser(Markup(section=("<seed:tool_call>", "</seed:tool_call>"), **_QWEN3_XML,
                                     write_param="<parameter={key}>{value}</parameter>\n"),
                              "Seed-OSS: Qwen3-Coder's calls inside `<seed:tool_call>`.")
GlmParser = markup_parser(Markup(section=("<tool_call>", "</tool_call>"), **_GLM),
                          "GLM-4.5 to 4.7: `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>value</arg_value>"
                          "</tool_call>`.")
MiniMaxM2Parser = markup_parser(Markup(
    section=("<minimax:tool_call>", "</minimax:tool_call>"), head=r'\s*<invoke name="(?P<name>[^"]+)">',
    marker="<invoke", params=Params(r'<parameter name="(?P<key>[^"]+)">', "</parameter>"), close="</invoke>",
    write='\n<invoke name="{name}">\n{args}</invoke>', write_param='<parameter name="{key}">{value}</parameter>\n'),
    'MiniMax-M2: `<minimax:tool_call><invoke name="NAME"><parameter name="KEY">value</parameter></invoke>'
    '</minimax:tool_call>`.')
MiniMaxM3Parser = markup_parser(Markup(
    section=(MINIMAX_NS + "<tool_call>", MINIMAX_NS + "</tool_call>"),
    head=r"\s*" + regex_escape(MINIMAX_NS) + r'<invoke name="(?P<name>[^"]+)">', marker=MINIMAX_NS + "<invoke",
    params=Params(regex_escape(MINIMAX_NS) + r"<(?P<key>[^<>/\s]+)>", MINIMAX_NS + "</{key}>",
                  nested=minimax_m3_value, nested_rule=minimax_m3_rule),
    close=MINIMAX_NS + "</invoke>", write="\n" + MINIMAX_NS + '<invoke name="{name}">{args}' + MINIMAX_NS + "</invoke>",
    write_param=MINIMAX_NS + "<{key}>{value}" + MINIMAX_NS + "</{key}>"),
    "MiniMax-M3: `<tool_call><invoke name=\"NAME\"><KEY>value</KEY></invoke></tool_call>`, each tag after "
    "`]<]minimax[>[`, objects and arrays as nested tags (`<item>` per element).", special=True)
KimiK3Parser = markup_parser(Markup(
    section=("<|open|>tools<|sep|>", "<|close|>tools<|sep|>"),
    head=r'\s*<\|open\|>call tool="(?P<name>[^"]+)" index="\d+"<\|sep\|>', marker="<|open|>call",
    params=Params(r'<\|open\|>argument key="(?P<key>[^"]+)" type="(?P<type>[a-z]+)"<\|sep\|>',
                  "<|close|>argument<|sep|>"),
    close="<|close|>call<|sep|>", write='<|open|>call tool="{name}" index="{index}"<|sep|>{args}<|close|>call<|sep|>',
    write_param='<|open|>argument key="{key}" type="{type}"<|sep|>{value}<|close|>argument<|sep|>'),
    'Kimi-K3: `<|open|>call tool="NAME" index="1"<|sep|><|open|>argument key="KEY" type="TYPE"<|sep|>value'
    '<|close|>argument<|sep|><|close|>call<|sep|>` in `<|open|>tools<|sep|>`.', special=True)
DotsParser = markup_parser(Markup(
    section=("<dots_function_call>", "</dots_function_call>"), head=r'\s*<invoke name="?(?P<name>[^">]+)"?>',
    marker="<invoke", params=Params(r'<parameter name="?(?P<key>[^">]+)"?>', "</parameter>"), close="</invoke>",
    write='\n<invoke name="{name}">\n{args}</invoke>', write_param='<parameter name="{key}">\n{value}\n</parameter>\n'),
    'dots: MiniMax-M2\'s invocations, each value on its own lines, in `<dots_function_call>`.')
DeepSeekV32Parser = markup_parser(Markup(section=("<｜DSML｜function_calls>", "</｜DSML｜function_calls>"),
                                         **_DSML_PARAMS),
                                  'DeepSeek-V3.2: `<｜DSML｜invoke name="NAME"><｜DSML｜parameter name="KEY" '
                                  'string="true">value</｜DSML｜parameter>` in `<｜DSML｜function_calls>`.',
                                  special=True)
DeepSeekV4Parser = markup_parser(Markup(section=("<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"), **_DSML_PARAMS),
                                 "DeepSeek-V4: V3.2's invocations inside `<｜DSML｜tool_calls>`.", special=True)
Step3Parser = markup_parser(Markup(
    section=("<｜tool_calls_begin｜>", "<｜tool_calls_end｜>"),
    head=r'\s*<｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name="(?P<name>[^"]+)">',
    marker="<｜tool_call_begin｜>",
    params=Params(r'<steptml:parameter name="(?P<key>[^"]+)">', "</steptml:parameter>"),
    close="</steptml:invoke><｜tool_call_end｜>",
    write='<｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name="{name}">{args}</steptml:invoke>'
          "<｜tool_call_end｜>",
    write_param='<steptml:parameter name="{key}">{value}</steptml:parameter>'),
    'Step-3: `<｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name="NAME"><steptml:parameter '
    'name="KEY">value</steptml:parameter></steptml:invoke><｜tool_call_end｜>` in `<｜tool_calls_begin｜>`.',
    special=True)
DeepSeekV3Parser = markup_parser(Markup(
    section=_DEEPSEEK_SECTION,
    head=r"\s*<｜tool▁call▁begin｜>(?:function)?<｜tool▁sep｜>(?P<name>[^\n<]+)\n```(?:json)?\n",
    marker="<｜tool▁call▁begin｜>", close="```<｜tool▁call▁end｜>",
    write="<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"),
    "DeepSeek-V3 and R1: `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and a ```json block.",
    special=True)
DeepSeekV31Parser = markup_parser(Markup(
    section=_DEEPSEEK_SECTION, head=r"\s*<｜tool▁call▁begin｜>(?P<name>[^<\n]+?)<｜tool▁sep｜>",
    marker="<｜tool▁call▁begin｜>", close="<｜tool▁call▁end｜>",
    write="<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>"),
    "DeepSeek-V3.1: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>`.", special=True)
FunctionaryV31Parser = markup_parser(Markup(head=r"<function=(?P<name>[^>\n]+)>", marker="<function=",
                                            close="</function>", write="<function={name}>{args}</function>"),
                                     "Functionary v3.1: `<function=NAME>{json}</function>`.")


class FunctionaryV32Parser(MarkupParser):
    """Functionary v3.2: `>>>NAME\\n{json}`; `>>>all` opens text for the user. The generation prompt ends with
    the first `>>>`, so the reply starts with a name."""
    spec = Markup(head=r">>>(?P<name>[^\n]+)\n", marker=">>>", content_names=frozenset({"all"}))

    def scan(self, text, final):
        if not text.startswith(">>>"):
            if not final and ">>>".startswith(text):
                return Scan("")
            text = ">>>" + text
        return super().scan(text, final)

    def forced_grammar(self, calls, single, specials):
        # The first call's `>>>` is the prompt's; each further call writes its own.
        rules, call = forced.call_rules(calls, lambda _, c: f"{json.dumps(c.name + chr(10))} "
                                                           f"{forced.json_value(c.parameters)}")
        more = "" if single else f" ({forced.literal('>>>', specials)} {call})*"
        return f"start: {call}{more}\n{rules}"

class MuseGlimmerParser(MarkupParser):
    """Muse Glimmer (ATEM): each call a message to the tool, `<|start|>assistant to=NAME<|message|>` and
    `<atem:function_calls><atem:invoke name="NAME"><atem:parameter name="KEY">value</atem:parameter>
    </atem:invoke></atem:function_calls>` (the `muse_glimmer` reasoning parser hands over the bodies). Forced calls
    write the messages from the reply's first token: the prompt wrote the first `<|start|>assistant`."""
    needs_special_tokens = True
    forced_from_start = True
    spec = Markup(section=("<atem:function_calls>", "</atem:function_calls>"),
                  head=r'\s*<atem:invoke name="(?P<name>[^"]+)">', marker="<atem:invoke",
                  params=Params(r'\s*<atem:parameter name="(?P<key>[^"]+)">', "</atem:parameter>"),
                  close="</atem:invoke>",
                  write=' to={name}<|message|><atem:function_calls>\n<atem:invoke name="{name}">\n{args}'
                        '</atem:invoke>\n</atem:function_calls>',
                  write_param='<atem:parameter name="{key}">{value}</atem:parameter>\n',
                  call_separator="<|eom|><|start|>assistant")

    def scan(self, text, final):  # without its reasoning parser, the message headers are no content
        return super().scan(_ATEM_HEADER.sub("", text), final) if "to=" in text else super().scan(text, final)


_ATEM_HEADER = re.compile(r"(?:<\|start\|>assistant)? to=[^<\s]+<\|message\|>|<\|eom\|>|<\|eot\|>")

SolarOpenParser = markup_parser(Markup(
    section=("<|tool_calls|>", "<|calls|>"),
    head=r"\s*<\|tool_call:begin\|>(?P<id>[^<]*)<\|tool_call:name\|>(?P<name>[^<]+)<\|tool_call:args\|>",
    marker="<|tool_call:begin|>", close="<|tool_call:end|>",
    write="<|tool_call:begin|>{id}<|tool_call:name|>{name}<|tool_call:args|>{args}<|tool_call:end|>"),
    "Solar Open: `<|tool_call:begin|>ID<|tool_call:name|>NAME<|tool_call:args|>{json}<|tool_call:end|>`.",
    special=True)
Gemma4Parser = markup_parser(Markup(head=r"<\|tool_call>call:" + _NAME, marker="<|tool_call>",
                                    close="<tool_call|>", convert=gemma_arguments,
                                    write="<|tool_call>call:{name}{args}<tool_call|>", notation=GemmaNotation),
                             'Gemma 4: `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>`.', special=True)
FunctionGemmaParser = markup_parser(Markup(
    head=r"<start_function_call>call:" + _NAME, marker="<start_function_call>", close="<end_function_call>",
    convert=function_gemma_arguments, write="<start_function_call>call:{name}{args}<end_function_call>",
    notation=FunctionGemmaNotation),
    "FunctionGemma: `<start_function_call>call:NAME{key:<escape>text<escape>,n:3}<end_function_call>`.",
    special=True)
MiniCPMParser = markup_parser(Markup(head=r'<function name="(?P<name>[^"]+)">', marker='<function name="',
                                     params=Params(r'<param name="(?P<key>[^"]+)">', "</param>"),
                                     close="</function>", write='<function name="{name}">{args}</function>',
                                     write_param='<param name="{key}">{value}</param>'),
                              'MiniCPM 5: `<function name="NAME"><param name="KEY">value</param></function>`.')
def _hunyuan(suffix: str) -> Markup:
    """Hunyuan's calls (GLM's keys and values) with each tag suffixed as the checkpoint's tokens are."""
    tag = lambda name: f"<{name}{suffix}>"
    e = regex_escape
    return Markup(
        section=(tag("tool_calls"), tag("/tool_calls")),
        head=r"\s*" + e(tag("tool_call")) + r"(?P<name>[^<]+?)" + e(tag("tool_sep")), marker=tag("tool_call"),
        params=Params(e(tag("arg_key")) + r"(?P<key>[^<]*)" + e(tag("/arg_key")) + r"\s*" + e(tag("arg_value")),
                      tag("/arg_value")),
        close=tag("/tool_call"),
        write="\n" + tag("tool_call") + "{name}" + tag("tool_sep") + "\n{args}" + tag("/tool_call"),
        write_param=tag("arg_key") + "{key}" + tag("/arg_key") + "\n" + tag("arg_value") + "{value}"
                    + tag("/arg_value") + "\n")


HunyuanParser = markup_parser(_hunyuan(":opensource"), "Hunyuan 3: GLM's keys and values, each tag suffixed "
                              "`:opensource`.", special=True)


@functools.lru_cache(maxsize=None)
def _hunyuan_parser(suffix: str) -> type[MarkupParser]:
    return markup_parser(_hunyuan(suffix), f"HY v4 with the tag suffix {suffix!r}.", special=True)


class HunyuanV4Parser(ToolParser):
    """HY v4: Hunyuan 3's calls with the checkpoint's own suffix on each tag (`<tool_calls:6124c78e>`, or none),
    read from the calls' opening tag, and for forced calls from the tokenizer's special tokens."""
    needs_special_tokens = True
    marker = "<tool_calls"
    _OPEN = re.compile(r"<tool_calls(:\w+)?>")
    _PARTIAL = re.compile(r"<tool_calls(:\w*)?$")

    def __init__(self, tools=None):
        super().__init__(tools)
        self._by_suffix: dict[str, MarkupParser] = {}  # one per suffix: a scan runs at every streamed piece

    def _parser(self, suffix: str) -> MarkupParser:
        if suffix not in self._by_suffix:
            parser = _hunyuan_parser(suffix)()
            parser.tools = self.tools
            self._by_suffix[suffix] = parser
        return self._by_suffix[suffix]

    def scan(self, text, final):
        opened = self._OPEN.search(text)
        if opened is None and not final and (partial := self._PARTIAL.search(text)):
            return Scan(text[:partial.start()])  # the suffix is still being written
        return self._parser(opened.group(1) or "" if opened else "").scan(text, final)

    def forced_grammar(self, calls, single, specials):
        suffix = next((t[len("<tool_calls"):-1] for t in specials if self._OPEN.fullmatch(t)), "")
        return self._parser(suffix).forced_grammar(calls, single, specials)


MiniMaxParser = tagged_json("<tool_calls>", "</tool_calls>",
                            "MiniMax-M1, Apriel: JSON calls (one per line, or a list) in `<tool_calls>`.",
                            layout="either")
GraniteParser = tagged_json("<|tool_call|>", None, "Granite 3: `<|tool_call|>[{json}, ...]`.", special=True,
                            layout="list")
NemotronParser = tagged_json("<TOOLCALL>", "</TOOLCALL>", "Nemotron Nano 2: `<TOOLCALL>[{json}, ...]</TOOLCALL>`.",
                             layout="list")
CommandRParser = tagged_json("<|START_ACTION|>", "<|END_ACTION|>",
                             'Command R7B: `<|START_ACTION|>[{"tool_name": ..., "parameters": ...}]'
                             '<|END_ACTION|>`.', name_keys=("tool_name", "name"),
                             argument_keys=("parameters", "arguments"), special=True, id_key="tool_call_id",
                             layout="list")
InklingParser = tagged_json("<|message_model|><|content_invoke_tool_json|>", "<|end_message|>",
                            "Inkling: `<|message_model|><|content_invoke_tool_json|>{json}<|end_message|>`.",
                            special=True, also_open=("<|content_invoke_tool_json|>",))
GigaChatParser = tagged_json("<|function_call|>", None,
                             "GigaChat 3.1: `<|function_call|>{json}`; GigaChat 3: the call as its own message, "
                             "`<|message_sep|>\n\nfunction call<|role_sep|>\n{json}`.",
                             also_open=("<|message_sep|>\n\nfunction call<|role_sep|>",), special=True)
LongCatParser = tagged_json("<longcat_tool_call>", "</longcat_tool_call>",
                            "LongCat: `<longcat_tool_call>{json}</longcat_tool_call>`.")
InternLMParser = tagged_json("<|action_start|><|plugin|>", "<|action_end|>",
                             'InternLM 2.5: `<|action_start|><|plugin|>{"name": ..., "parameters": ...}'
                             '<|action_end|>`.',
                             special=True)
Granite20bParser = tagged_json("<function_call>", None,
                               "Granite 20B function calling: `<function_call> {json}` for each call.")
ApertusParser = tagged_json("<|tools_prefix|>", "<|tools_suffix|>",
                            'Apertus: `<|tools_prefix|>[{"NAME": {json}}, ...]<|tools_suffix|>`.', name_keys=None,
                            special=True, layout="list")
Phi4MiniParser = tagged_json("functools", None, "Phi-4-mini: `functools[{json}, ...]`.", layout="list")


@dataclass(frozen=True)
class Format:
    names: tuple[str, ...]  # TOOL_CALL_PARSER names; the first is the one reported
    parser: type[ToolParser]
    families: str


# In recognition order: where two formats would read the same text, the first is chosen.
FORMATS: tuple[Format, ...] = (
    Format(("hermes", "qwen", "qwen2_5", "qwen3", "ernie45", "granite4"), HermesParser,
           "Qwen2.5, Qwen3, QwQ, Hermes 2/3, Granite 4, MiMo, Bielik"),
    Format(("qwen3_coder", "qwen3_xml", "step3p5", "mimo"), Qwen3XmlParser,
           "Qwen3-Coder, Qwen3.5, Nemotron 3 Nano, Step 3.5"),
    Format(("glm45", "glm47", "glm4_moe", "ling3", "poolside_v1"), GlmParser, "GLM-4.5, 4.6, 4.7, Ling 3, Laguna"),
    Format(("seed_oss",), SeedOssParser, "Seed-OSS"),
    Format(("minimax_m2",), MiniMaxM2Parser, "MiniMax-M2"),
    Format(("minimax_m3",), MiniMaxM3Parser, "MiniMax-M3"),
    Format(("dots",), DotsParser, "dots"),
    Format(("minimax", "apriel", "jamba", "hunyuan_a13b"), MiniMaxParser,
           "MiniMax-M1, Apriel 1.5/1.6, Jamba 1.5+, Hunyuan-A13B"),
    Format(("kimi_k2",), KimiK2Parser, "Kimi-K2"),
    Format(("kimi_k3",), KimiK3Parser, "Kimi-K3"),
    Format(("deepseek_v3", "deepseek_r1"), DeepSeekV3Parser, "DeepSeek-V3, R1 and its Qwen distills"),
    Format(("deepseek_v31",), DeepSeekV31Parser, "DeepSeek-V3.1"),
    Format(("deepseek_v32",), DeepSeekV32Parser, "DeepSeek-V3.2"),
    Format(("deepseek_v4",), DeepSeekV4Parser, "DeepSeek-V4"),
    Format(("step3",), Step3Parser, "Step-3"),
    Format(("mistral",), MistralParser, "Mistral, Mistral Nemo/Small, Ministral, Devstral"),
    Format(("openai",), HarmonyToolParser, "gpt-oss (harmony)"),
    Format(("llama3_json", "llama", "llama4_json"), Llama3JsonParser, "Llama 3.1, 3.2, 3.3, 4 (JSON)"),
    Format(("functionary_v3_1", "functionary"), FunctionaryV31Parser, "Functionary v3.1"),
    Format(("functionary_v3_2",), FunctionaryV32Parser, "Functionary v3.2"),
    Format(("granite",), GraniteParser, "Granite 3.x"),
    Format(("granite-20b-fc",), Granite20bParser, "Granite 20B function calling"),
    Format(("nemotron_json",), NemotronParser, "Nemotron Nano 2"),
    Format(("command_r", "cohere_command3", "cohere_command4"), CommandRParser, "Command R7B, Command A"),
    Format(("gemma4",), Gemma4Parser, "Gemma 4"),
    Format(("functiongemma",), FunctionGemmaParser, "FunctionGemma"),
    Format(("muse_glimmer",), MuseGlimmerParser, "Muse Glimmer"),
    Format(("solar_open",), SolarOpenParser, "Solar Open"),
    Format(("minicpm", "minicpm5"), MiniCPMParser, "MiniCPM 5"),
    Format(("hunyuan", "hy_v3"), HunyuanParser, "Hunyuan 3"),
    Format(("hy_v4",), HunyuanV4Parser, "HY v4"),
    Format(("gigachat3",), GigaChatParser, "GigaChat 3, 3.1"),
    Format(("longcat",), LongCatParser, "LongCat-Flash"),
    Format(("inkling",), InklingParser, "Inkling"),
    Format(("internlm",), InternLMParser, "InternLM 2.5"),
    Format(("phi4_mini_json",), Phi4MiniParser, "Phi-4-mini"),
    Format(("apertus",), ApertusParser, "Apertus"),
    Format(("xlam",), XLamParser, "xLAM (Llama and Qwen based)"),
    Format(("lfm2",), LFM2Parser, "LFM2, LFM2.5"),
    Format(("pythonic", "llama4_pythonic", "olmo3"), PythonicParser, "Llama 3.2 (pythonic), Llama 4, OLMo 3"),
)

PARSERS: dict[str, type[ToolParser]] = {name: f.parser for f in FORMATS for name in f.names}
