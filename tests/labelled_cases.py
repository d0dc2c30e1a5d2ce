"""Labelled completion records for every shape of issue 43 ("What real Qwen3.6 data holds that we
miss"), each bad record with a good twin: the same record made right (the legit repetition, the tag
quoted in code, the translation that was asked for, the short correct answer...).

Written apart from the checks they measure (issue 43: cases written by the fixer measure nothing),
so they follow the issue's shapes and the real formats (Qwen3.6's raw output: reasoning, ``</think>``,
the answer, tool calls in its XML format; Hermes JSON for a Qwen3 model; tools in OpenAI format),
never a check's code. ``cases()`` is deterministic (seeded); ``verdicts`` judges them as the
validate stage does and ``scores`` sums them up. Used by tests/test_labelled.py and
bench/validation_quality.py; it imports only what older code has too (``make_completion``,
``validate_for_target``, the config's defaults), so the bench measures code before a change as well.

A case is (shape, label, expected codes, record): label "bad" (rejected with any one of the codes
counts as caught) or "good" (expected codes empty). Ids are ``<shape>-<n>-bad`` / ``<shape>-<n>-good``:
the twins share ``<shape>-<n>``. Every completion is unique but where ``duplicate_completion``
repeats one on purpose (its twins are judged together, the original first).
"""
from __future__ import annotations

import json
import random
import tempfile
from collections import defaultdict
from pathlib import Path

from dflash.core.config import defaults
from dflash.core.io import iter_jsonl, write_jsonl_zst
from dflash.core.records import make_completion
import dflash.validate.stage as stage

DEMO_TARGET = Path(__file__).resolve().parents[1] / "data" / "demo" / "target"

SOURCE = "labelled-i43"
QWEN36 = "Qwen/Qwen3.6-27B"  # XML tool calls (SGLang's qwen3_coder parser)
QWEN3 = "Qwen/Qwen3-8B"  # Hermes JSON tool calls (qwen25 parser)
CAPS = (4096, 8192, 16384, 32768)


def _fn(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


TOOLS = {t["function"]["name"]: t for t in [
    _fn("get_weather", "Current weather and forecast for a city.",
        {"city": {"type": "string", "description": "City name"},
         "days": {"type": "integer", "minimum": 1, "maximum": 10, "description": "Forecast days"},
         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"]),
    _fn("search_web", "Search the web and return the top results.",
        {"query": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1}}, ["query"]),
    _fn("write_file", "Write text to a file in the workspace, replacing it.",
        {"path": {"type": "string"}, "content": {"type": "string"}}, ["path", "content"]),
    _fn("run_sql", "Run a read-only SQL query on the analytics database.",
        {"query": {"type": "string"}, "limit": {"type": "integer"}}, ["query"]),
    _fn("send_email", "Send an email.",
        {"to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}}, ["to", "subject", "body"]),
    _fn("get_stock_price", "Latest price of a stock by ticker symbol.",
        {"symbol": {"type": "string"}}, ["symbol"]),
    _fn("set_alert", "Create a price alert.",
        {"symbol": {"type": "string"}, "threshold": {"type": "number"}, "direction": {"type": "string",
                                                                                      "enum": ["above", "below"]}},
        ["symbol", "threshold"]),
    _fn("create_event", "Create a calendar event.",
        {"title": {"type": "string"}, "start": {"type": "string", "description": "ISO 8601"},
         "duration_minutes": {"type": "integer"}}, ["title", "start"]),
    # the dialects real tools come in: pydantic/MCP optional (anyOf with null), a union, no type at all
    _fn("lookup_address", "Look up a US address.",
        {"street": {"type": "string"}, "zip_code": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}},
        ["street", "zip_code"]),
    _fn("get_order", "Fetch an order by id.",
        {"order_id": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}, ["order_id"]),
    _fn("tag_item", "Attach a tag to a catalogue item.",
        {"item": {"description": "Item id as shown in the catalogue"}, "tag": {"type": "string"}}, ["item", "tag"]),
]}


def _tokens(text: str) -> int:
    """A rough token count (about 4 characters of ASCII a token, a CJK character most of one)."""
    ascii_chars = sum(1 for c in text if ord(c) < 128)
    return ascii_chars // 4 + (len(text) - ascii_chars) * 3 // 4 + 1


def _record(rid: str, category: str, user: str | list[dict], text: str, *, tools: list[str] | None = None,
            finish: str = "stop", model: str = QWEN36, used: int | None = None, cap: int | None = None,
            thinking: bool = True, seed: int = 0) -> dict:
    messages = [{"role": "user", "content": user}] if isinstance(user, str) else user
    offered = [TOOLS[n] for n in tools] if tools else None
    used = used if used is not None else _tokens(text)
    cap = cap or next(c for c in CAPS if c > 2 * used)
    prompt = {"id": rid, "source": SOURCE, "category": category, "messages": messages, "tools": offered}
    generation = {"backend": "sglang", "engine_version": "0.5.23", "model": model, "enable_thinking": thinking,
                  "sampling": {"temperature": 1.0 if thinking else 0.7, "top_p": 0.95, "top_k": 20, "seed": seed,
                               "max_tokens": cap}}
    prompt_tokens = _tokens(json.dumps(messages, ensure_ascii=False)) + (_tokens(json.dumps(offered)) if offered else 0)
    return make_completion(prompt, text, finish, generation, usage=(prompt_tokens + 12, used))


def think(reasoning: str, answer: str) -> str:
    """Qwen3.6's raw output in thinking mode: it starts inside the reasoning (no <think>)."""
    return f"{reasoning}\n</think>\n\n{answer}"


def xml_call(name: str, **params) -> str:
    body = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
                   for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def hermes_call(name: str, args: dict | str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}}}\n</tool_call>'


# ---- content banks: (question, reasoning, answer) -------------------------------------------------

CHAT = [
    ("What's the difference between a latte and a cappuccino?",
     "Okay, the user wants the difference between a latte and a cappuccino. Both are espresso plus steamed milk. "
     "The difference is the ratio and the foam: a cappuccino is roughly equal thirds of espresso, steamed milk and "
     "foam, smaller and stronger; a latte has much more steamed milk and only a thin layer of microfoam. I should "
     "keep it short and mention the cup sizes too.",
     "Both start with a shot of espresso; the difference is the milk.\n\n- **Cappuccino**: about equal parts "
     "espresso, steamed milk and a thick cap of foam, usually in a 150-180 ml cup. It tastes stronger and feels "
     "airy.\n- **Latte**: mostly steamed milk with a thin layer of microfoam, usually 240 ml or more. It is milder "
     "and creamier.\n\nIf you like the coffee flavour to come through, go for a cappuccino; if you want something "
     "smooth and milky, a latte."),
    ("How do I politely decline a meeting invite from my manager?",
     "The user needs a polite way to decline a meeting from their manager. Key points: thank them, give a brief "
     "reason, offer an alternative (async update or another time), keep it short. A template would help.",
     "Keep it short, give a reason, and offer an alternative so it doesn't read as a brush-off. For example:\n\n"
     "> Hi Dana, thanks for including me. I'm heads-down on the release checklist at that time and would like to "
     "keep that block. Could I send you a written update before the meeting instead, or join for the first 10 "
     "minutes? Happy to move things if my input is essential.\n\nAdjust the reason to your situation; the offer of "
     "an alternative is what makes it land well."),
    ("Why is the sky blue?",
     "The user asks why the sky is blue. Rayleigh scattering: air molecules scatter shorter wavelengths much more "
     "strongly, proportional to 1/wavelength^4. Blue light is scattered across the sky, so we see blue from all "
     "directions. Why not violet? The sun emits less violet, some is absorbed high up, and our eyes are less "
     "sensitive to it. Sunsets are red because light passes through more air and blue is scattered out.",
     "Sunlight contains all colours, and as it passes through the atmosphere the nitrogen and oxygen molecules "
     "scatter short wavelengths far more than long ones (Rayleigh scattering, roughly proportional to 1/λ⁴). Blue "
     "light gets bounced around the whole sky, so wherever you look away from the sun you see scattered blue.\n\n"
     "Violet is scattered even more, but the sun emits less of it and our eyes are less sensitive to it, so the "
     "sky looks blue rather than violet. At sunset the light crosses much more air, most of the blue is scattered "
     "away before it reaches you, and the reds and oranges remain."),
    ("Can you suggest a name for a small bakery that specialises in sourdough?",
     "The user wants name ideas for a sourdough bakery. A list of options with a short note on each would be "
     "useful: wordplay on starter, crust, rise, wild yeast. Give maybe six options and a tip about checking the "
     "domain and local trademarks.",
     "Here are a few ideas:\n\n1. **Wild Rise** - a nod to wild yeast.\n2. **The Starter Club** - friendly, hints "
     "at the sourdough starter.\n3. **Crumb & Crust** - classic bakery feel.\n4. **Slow Loaf** - for long "
     "fermentation.\n5. **Mother Dough** - the baker's term for the starter.\n6. **Levain Lane** - works well if "
     "you are on a named street.\n\nBefore settling, check that the domain and social handles are free and that no "
     "bakery nearby uses a similar name."),
    ("What are some tips for sleeping better?",
     "The user wants tips for sleeping better. Evidence-based sleep hygiene: consistent schedule, light exposure "
     "in the morning, limit caffeine after noon, cool dark room, avoid screens and heavy meals before bed, "
     "exercise but not too late, don't lie awake in bed for long. Mention seeing a doctor if insomnia persists.",
     "A few habits with good evidence behind them:\n\n- Keep the same wake-up time every day, weekends included.\n"
     "- Get daylight in the morning and dim the lights in the evening.\n- Stop caffeine by early afternoon and go "
     "easy on alcohol, which fragments sleep.\n- Keep the bedroom cool, dark and quiet.\n- If you can't sleep "
     "after about 20 minutes, get up and do something calm until you feel sleepy.\n\nIf poor sleep goes on for "
     "weeks despite this, it's worth talking to a doctor; insomnia and sleep apnoea are both treatable."),
    ("Explain what an index fund is to a teenager.",
     "The user wants an explanation of index funds for a teenager. Use a simple analogy: buying a tiny slice of "
     "every company in a list like the S&P 500 instead of picking one. Low fees, diversification, grows with the "
     "market over time. Avoid jargon, maybe a pizza or basket analogy.",
     "Imagine you want to own part of the 500 biggest US companies, but buying shares of each one would cost a "
     "fortune. An index fund does it for you: you put in your money, and the fund buys a tiny slice of all of "
     "them, following a list (an \"index\") such as the S&P 500.\n\nWhy people like them:\n- **Spread risk**: if "
     "one company does badly, the others soften the blow.\n- **Cheap**: nobody is paid to pick stocks, so fees are "
     "low.\n- **Grows with the economy**: over long periods the market has tended to go up, with bumps along the "
     "way.\n\nThe catch: in a bad year it drops too. It works best for money you can leave alone for many years."),
    ("Write a short birthday message for my grandmother who is turning 90.",
     "The user wants a short birthday message for a grandmother turning 90. Warm, personal, not too long. Mention "
     "90 years, gratitude, love, maybe her stories or cooking as a placeholder they can personalise.",
     "Happy 90th birthday, Grandma!\n\nNinety years of kindness, stories and the best Sunday dinners anyone could "
     "ask for. Thank you for everything you have taught us and for the love you give so freely. We are so lucky "
     "to celebrate you today. With all our love, and many hugs."),
    ("Is it safe to leave cooked rice out overnight?",
     "The user asks if cooked rice left out overnight is safe. Bacillus cereus spores survive cooking; at room "
     "temperature they germinate and produce toxins that reheating does not destroy. Guidance: cool within an "
     "hour, refrigerate, eat within a day, reheat until steaming hot, only once. So overnight at room "
     "temperature is not safe.",
     "It's best not to. Rice can carry spores of *Bacillus cereus* that survive cooking. Left at room temperature, "
     "they grow and make toxins that reheating does not destroy, which can cause vomiting or diarrhoea.\n\nSafer "
     "habits:\n- Cool leftover rice quickly (within about an hour) and put it in the fridge.\n- Eat it within a "
     "day.\n- Reheat it until it is steaming hot all the way through, and only once.\n\nIf it sat out all night, "
     "throw it away."),
]

CODE = [
    ("Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
     "The user wants a palindrome check ignoring case and punctuation. Filter to alphanumeric characters, "
     "lowercase, compare with the reverse. Use str.isalnum. Add a couple of examples.",
     "```python\ndef is_palindrome(text: str) -> bool:\n    \"\"\"True if text reads the same backwards, ignoring "
     "case and non-alphanumeric characters.\"\"\"\n    cleaned = [c.lower() for c in text if c.isalnum()]\n    "
     "return cleaned == cleaned[::-1]\n\n\nprint(is_palindrome(\"A man, a plan, a canal: Panama\"))  # True\n"
     "print(is_palindrome(\"Hello, world\"))  # False\n```\n\nIt keeps only letters and digits, lowercases them and "
     "compares the list with its reverse, so it runs in O(n)."),
    ("How do I read a CSV file with pandas and keep only the rows where the 'status' column is 'active'?",
     "They want pandas: read_csv then boolean indexing on status == 'active'. Mention stripping whitespace or "
     "case differences maybe. Short code.",
     "```python\nimport pandas as pd\n\ndf = pd.read_csv(\"users.csv\")\nactive = df[df[\"status\"] == \"active\"]\n"
     "print(len(active), \"active rows\")\n```\n\nIf the column may have stray spaces or mixed case, normalise it "
     "first:\n\n```python\nactive = df[df[\"status\"].str.strip().str.lower() == \"active\"]\n```"),
    ("Write a bash one-liner that finds the 10 largest files under the current directory.",
     "Use find with -type f and -printf size and path, sort numerically reversed, head -10. Or du. The find "
     "-printf approach is precise. Mention macOS lacks -printf, alternative with du.",
     "```bash\nfind . -type f -printf '%s\\t%p\\n' | sort -nr | head -10\n```\n\nIt prints each file's size in "
     "bytes and path, sorts by size descending and keeps the top 10. On macOS (BSD find has no `-printf`) use:\n\n"
     "```bash\nfind . -type f -exec du -k {} + | sort -nr | head -10\n```"),
    ("In JavaScript, how do I remove duplicates from an array of numbers?",
     "Simplest: spread a Set. Order is preserved by insertion. Alternative with filter and indexOf for older "
     "environments, but Set is fine everywhere modern.",
     "Use a `Set`, which keeps only unique values and preserves the first-seen order:\n\n```javascript\nconst "
     "numbers = [3, 1, 3, 2, 1];\nconst unique = [...new Set(numbers)];\nconsole.log(unique); // [3, 1, 2]\n```\n\n"
     "This is O(n). The older `numbers.filter((n, i) => numbers.indexOf(n) === i)` works too but is O(n²)."),
    ("Write a SQL query that returns each customer's total order amount for 2024, highest first.",
     "Join customers and orders, filter by order date in 2024, group by customer, sum amount, order by total "
     "desc. Use a date range rather than YEAR() so an index on order_date can be used.",
     "```sql\nSELECT c.id, c.name, SUM(o.amount) AS total_2024\nFROM customers AS c\nJOIN orders AS o ON o.customer_id "
     "= c.id\nWHERE o.order_date >= '2024-01-01' AND o.order_date < '2025-01-01'\nGROUP BY c.id, c.name\nORDER BY "
     "total_2024 DESC;\n```\n\nThe half-open date range lets the database use an index on `order_date`, which "
     "`YEAR(o.order_date) = 2024` would prevent."),
    ("Fix this Python: `for i in range(len(items)): if items[i] == target: return True` gives a syntax error.",
     "The user wrote a compound statement on one line: a for with an if body on the same line is not allowed. "
     "Need to split into lines, and it must be inside a function for return. Also the idiomatic way is `target "
     "in items`.",
     "Python doesn't allow a compound statement (`if`) as the body of another on the same line, and `return` "
     "only works inside a function. Split it up:\n\n```python\ndef contains(items, target):\n    for item in "
     "items:\n        if item == target:\n            return True\n    return False\n```\n\nOr simply `return "
     "target in items`, which does the same."),
]

REASONING = [
    ("A train leaves at 9:40 and arrives at 13:15. How long is the journey?",
     "From 9:40 to 13:40 is 4 hours. 13:15 is 25 minutes earlier than 13:40. So 4 hours minus 25 minutes = 3 "
     "hours 35 minutes. Check: 9:40 + 3:00 = 12:40, + 35 minutes = 13:15. Correct.",
     "The journey takes **3 hours 35 minutes** (9:40 + 3 h = 12:40, plus 35 min = 13:15)."),
    ("If 3 workers build a wall in 12 days, how long would 4 workers take at the same rate?",
     "Total work is 3 workers × 12 days = 36 worker-days. With 4 workers: 36 / 4 = 9 days. Assumes the work "
     "divides perfectly and each worker is equally productive.",
     "The wall takes 3 × 12 = 36 worker-days, so 4 workers need 36 ÷ 4 = **9 days**, assuming they work at the "
     "same rate and the job splits evenly."),
    ("What is the sum of the integers from 1 to 200?",
     "Use the formula n(n+1)/2 with n = 200: 200 × 201 / 2 = 100 × 201 = 20100. Double-check by pairing: 1+200 = "
     "201, there are 100 such pairs, 100 × 201 = 20100.",
     "Using n(n+1)/2 with n = 200: 200 × 201 ÷ 2 = **20,100**."),
    ("A shirt costs $40 after a 20% discount. What was the original price?",
     "After a 20% discount the price is 80% of the original. So 0.8 × P = 40, P = 40 / 0.8 = 50. Check: 20% of 50 "
     "is 10, 50 - 10 = 40. Yes.",
     "The sale price is 80% of the original, so the original price was 40 ÷ 0.8 = **$50** (20% of $50 is $10, "
     "and $50 − $10 = $40)."),
    ("Is 221 a prime number?",
     "Check divisibility by primes up to sqrt(221) ≈ 14.9: 2 no, 3: 2+2+1 = 5 no, 5 no, 7: 7 × 31 = 217, "
     "remainder 4, no. 11: 11 × 20 = 220, remainder 1, no. 13: 13 × 17 = 221. Yes! So 221 = 13 × 17, not prime.",
     "No. 221 = 13 × 17, so it is composite."),
    ("Alice is older than Bob, Bob is older than Carol, and Dave is younger than Carol. Who is the youngest?",
     "Order: Alice > Bob > Carol > Dave in age. Dave is younger than Carol, who is younger than Bob and Alice. So "
     "Dave is the youngest.",
     "From oldest to youngest: Alice, Bob, Carol, Dave. **Dave** is the youngest."),
]

# Chinese prompts: Qwen3.6 often reasons in English and answers in Chinese.
ZH = [
    ("如何提高英语口语水平？",
     "The user asks in Chinese how to improve spoken English. Answer in Chinese: daily speaking practice, "
     "shadowing, recording yourself, language exchange partners, learning chunks rather than single words.",
     "提高英语口语可以从这几方面入手：\n\n1. **每天开口**：哪怕只有十五分钟，也比每周突击一次更有效。\n2. **跟读（shadowing）**："
     "选一段地道的音频，一句一句模仿语音语调。\n3. **录音回听**：录下自己的回答，找出发音和停顿的问题。\n4. **找语伴**：通过语言交换"
     "或线上课程获得真实对话的机会。\n5. **积累整句表达**：记住常用搭配和句型，而不是孤立的单词。\n\n坚持两三个月，会明显感觉到变化。"),
    ("解释一下什么是机器学习中的过拟合。",
     "用户问过拟合。过拟合是模型在训练集上表现很好，但在新数据上表现差，因为它记住了噪声。原因：模型太复杂、数据太少。解决办法：更多数据、"
     "正则化、早停、交叉验证、dropout。",
     "**过拟合**指模型把训练数据中的噪声和偶然规律也“背”了下来，结果在训练集上误差很低，在新数据上却表现很差。\n\n常见原因：\n- "
     "模型过于复杂（参数太多）；\n- 训练数据太少或不具代表性。\n\n常用对策：\n- 增加数据或做数据增强；\n- 正则化（L1/L2、dropout）；\n"
     "- 早停：验证集误差开始上升时停止训练；\n- 用交叉验证来选择模型复杂度。"),
    ("北京有哪些适合带孩子去的博物馆？",
     "The user wants child-friendly museums in Beijing. Candidates: China Science and Technology Museum, "
     "Beijing Natural History Museum, the Palace Museum, National Museum of China, Beijing Planetarium, "
     "China Railway Museum. Answer in Chinese with a short note each and a booking tip.",
     "推荐几个适合亲子的博物馆：\n\n- **中国科学技术馆**：互动展品很多，儿童科学乐园适合小一点的孩子。\n- **北京自然博物馆**："
     "恐龙化石和动物标本很受孩子欢迎。\n- **北京天文馆**：有球幕影院，适合对星空感兴趣的孩子。\n- **中国铁道博物馆**："
     "可以近距离看各种火车。\n- **故宫博物院**：适合大一点的孩子，边走边讲历史。\n\n大多数场馆需要提前在官方渠道预约，周末和假期名额紧张。"),
    ("用Python怎么把一个列表按第二个元素排序？",
     "The user asks in Chinese how to sort a list by its second element in Python. Use sorted with key=lambda "
     "x: x[1], or operator.itemgetter(1). Answer in Chinese with code.",
     "可以用 `sorted` 并指定 `key`：\n\n```python\ndata = [(\"a\", 3), (\"b\", 1), (\"c\", 2)]\nresult = sorted(data, "
     "key=lambda x: x[1])\nprint(result)  # [('b', 1), ('c', 2), ('a', 3)]\n```\n\n如果要降序，加上 `reverse=True`；"
     "也可以用 `operator.itemgetter(1)` 代替 lambda，速度略快。"),
    ("一个数的三倍加上五等于二十六，这个数是多少？",
     "设这个数为 x。3x + 5 = 26，所以 3x = 21，x = 7。验算：3 × 7 + 5 = 26，正确。",
     "设这个数为 x，则 3x + 5 = 26，3x = 21，所以 **x = 7**。验算：3 × 7 + 5 = 26。"),
    ("给我推荐几本适合初学者的经济学书。",
     "User wants beginner economics books, in Chinese. Options: 曼昆《经济学原理》, 《牛奶可乐经济学》, "
     "《魔鬼经济学》, 哈耶克 maybe too hard, 《经济学通识》薛兆丰. Give 4-5 with a line each.",
     "几本入门友好的经济学书：\n\n1. **《经济学原理》（曼昆）**：最经典的入门教材，例子多，体系完整。\n2. **《牛奶可乐经济学》**："
     "用日常现象讲经济学原理，轻松易读。\n3. **《魔鬼经济学》**：用数据分析社会问题，适合培养经济学思维。\n4. **《薛兆丰经济学讲义》**："
     "中文原创，贴近国内读者。\n\n建议先读第2、3本培养兴趣，再系统地读曼昆的教材。"),
]

TOOL_REQUESTS = [  # (user, reasoning, call name, arguments, answer preface or "")
    ("What's the weather going to be like in Lisbon for the next 3 days?",
     "The user wants a 3-day forecast for Lisbon. I have get_weather with city and days. Call it with city "
     "Lisbon and days 3.", "get_weather", {"city": "Lisbon", "days": 3}, ""),
    ("Find me recent articles about solid-state batteries.",
     "The user wants recent articles on solid-state batteries. Use search_web with a focused query.",
     "search_web", {"query": "solid-state battery breakthroughs 2025", "max_results": 5},
     "I'll search for recent coverage of solid-state batteries."),
    ("How many orders did we get per day last week? Use the analytics DB.",
     "Need a SQL query counting orders per day for last week. The run_sql tool is read-only. Group by date of "
     "created_at for the last 7 days.", "run_sql",
     {"query": "SELECT DATE(created_at) AS day, COUNT(*) AS orders\nFROM orders\nWHERE created_at >= CURRENT_DATE "
               "- INTERVAL '7 days'\nGROUP BY day\nORDER BY day;"}, ""),
    ("Email Priya (priya@example.com) that the design review moved to Thursday at 2pm.",
     "The user wants an email to Priya about the design review moving to Thursday 2pm. Use send_email with a "
     "clear subject and a short body.", "send_email",
     {"to": "priya@example.com", "subject": "Design review moved to Thursday 2pm",
      "body": "Hi Priya,\n\nQuick note: the design review has moved to Thursday at 2pm. Same room and agenda.\n\n"
              "Thanks!"}, ""),
    ("What's NVIDIA trading at right now?",
     "The user wants the current NVIDIA price. Ticker is NVDA. Call get_stock_price.",
     "get_stock_price", {"symbol": "NVDA"}, "Let me look up the latest NVDA price."),
    ("Put a 30 minute sync with the data team on my calendar for 2025-03-14 at 10:00.",
     "Create a calendar event titled 'Sync with data team', start 2025-03-14T10:00, 30 minutes.",
     "create_event", {"title": "Sync with data team", "start": "2025-03-14T10:00:00", "duration_minutes": 30}, ""),
    ("Save a README for my project 'tinyq' that says it's a tiny job queue for Python.",
     "The user wants a README file for tinyq. Use write_file with README.md and a short markdown content.",
     "write_file", {"path": "README.md", "content": "# tinyq\n\nA tiny job queue for Python.\n\n## Install\n\n"
                                                    "```bash\npip install tinyq\n```"}, ""),
    ("Alert me when AAPL goes above 250.",
     "Create a price alert: AAPL, threshold 250, direction above.",
     "set_alert", {"symbol": "AAPL", "threshold": 250, "direction": "above"}, ""),
]


class Builder:
    """Collects the cases; ``pair`` adds one bad record and its good twin."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.cases: list[tuple[str, str, tuple[str, ...], dict]] = []
        self.count: dict[str, int] = {}
        self.varied: set[tuple[str, str, str]] = set()

    def pair(self, shape: str, codes: tuple[str, ...], bad: dict, good: dict) -> None:
        n = self.count[shape] = self.count.get(shape, 0) + 1
        for label, kw, expected in (("bad", bad, codes), ("good", good, ())):
            kw = dict(kw)
            rec = _record(f"{shape}-{n}-{label}", kw.pop("category"), kw.pop("user"), kw.pop("text"),
                          seed=self.rng.randrange(1 << 30), **kw)
            self.cases.append((shape, label, expected, rec))

    def add(self, shape: str, label: str, codes: tuple[str, ...], rid: str, kw: dict) -> None:
        kw = dict(kw)
        rec = _record(rid, kw.pop("category"), kw.pop("user"), kw.pop("text"), seed=self.rng.randrange(1 << 30), **kw)
        self.cases.append((shape, label, codes, rec))

    def vary(self, reasoning: str) -> str:
        """``reasoning`` with an opening and a closing drawn afresh for each record, so that no two
        records of the corpus hold the same completion unless a shape means them to."""
        while True:
            opener, closer = self.rng.choice(OPENERS), self.rng.choice(CLOSERS)
            if (key := (reasoning, opener, closer)) not in self.varied:
                self.varied.add(key)
                return f"{opener}{reasoning}{closer}"


OPENERS = ("", "", "Let me think about this. ", "Alright. ", "Let me work through it. ", "Hmm. ",
           "First, what exactly is being asked? ", "Okay. ", "Let me see. ", "Right. ")
CLOSERS = ("", "", " That should cover it.", " I'll keep the answer concise.", " Let me write the answer now.",
           " I'll structure it clearly.", " Good, that's enough to answer.", " Let me put that together.",
           " I think that's right.", " Now the answer.")

# Enumerations a good answer lists line by line (distinct content on every line)
ENUMS = [
    ("List the first 20 US states in alphabetical order with their capitals.", "Here are the first 20 states "
     "alphabetically:", [f"{s} - {c}" for s, c in [
         ("Alabama", "Montgomery"), ("Alaska", "Juneau"), ("Arizona", "Phoenix"), ("Arkansas", "Little Rock"),
         ("California", "Sacramento"), ("Colorado", "Denver"), ("Connecticut", "Hartford"), ("Delaware", "Dover"),
         ("Florida", "Tallahassee"), ("Georgia", "Atlanta"), ("Hawaii", "Honolulu"), ("Idaho", "Boise"),
         ("Illinois", "Springfield"), ("Indiana", "Indianapolis"), ("Iowa", "Des Moines"), ("Kansas", "Topeka"),
         ("Kentucky", "Frankfort"), ("Louisiana", "Baton Rouge"), ("Maine", "Augusta"), ("Maryland", "Annapolis")]]),
    ("List the first 24 chemical elements with their symbols.", "The first 24 elements by atomic number:",
     [f"{n} ({s})" for n, s in [
         ("Hydrogen", "H"), ("Helium", "He"), ("Lithium", "Li"), ("Beryllium", "Be"), ("Boron", "B"),
         ("Carbon", "C"), ("Nitrogen", "N"), ("Oxygen", "O"), ("Fluorine", "F"), ("Neon", "Ne"), ("Sodium", "Na"),
         ("Magnesium", "Mg"), ("Aluminium", "Al"), ("Silicon", "Si"), ("Phosphorus", "P"), ("Sulfur", "S"),
         ("Chlorine", "Cl"), ("Argon", "Ar"), ("Potassium", "K"), ("Calcium", "Ca"), ("Scandium", "Sc"),
         ("Titanium", "Ti"), ("Vanadium", "V"), ("Chromium", "Cr")]]),
    ("What do the common HTTP status codes mean? One line each.", "The ones you will meet most often:", [
        "200 OK - the request succeeded", "201 Created - a new resource was made", "204 No Content - success, "
        "empty body", "301 Moved Permanently - use the new URL from now on", "302 Found - temporary redirect",
        "304 Not Modified - your cached copy is still valid", "400 Bad Request - the server could not parse it",
        "401 Unauthorized - authentication is missing or wrong", "403 Forbidden - authenticated but not allowed",
        "404 Not Found - nothing at this URL", "405 Method Not Allowed - wrong verb for this endpoint",
        "409 Conflict - clashes with the current state", "410 Gone - removed for good", "422 Unprocessable "
        "Content - well-formed but semantically invalid", "429 Too Many Requests - slow down (see Retry-After)",
        "500 Internal Server Error - the server failed", "502 Bad Gateway - an upstream answered badly",
        "503 Service Unavailable - overloaded or in maintenance", "504 Gateway Timeout - an upstream took too "
        "long"]),
    ("Give me a 14-day itinerary for Japan, one line per day.", "A first-timer's two weeks:", [
        "Arrive in Tokyo, settle in around Shinjuku and walk through Omoide Yokocho",
        "Asakusa and Senso-ji in the morning, then a river cruise to Hamarikyu gardens",
        "Day trip to Nikko for the Toshogu shrine and Kegon falls", "Harajuku, Meiji shrine and an evening in "
        "Shibuya", "Take the shinkansen to Hakone, ride the ropeway and stay in a ryokan",
        "Lake Ashi cruise, then continue to Kyoto", "Fushimi Inari early, Gion and Yasaka shrine in the "
        "afternoon", "Arashiyama bamboo grove, Tenryu-ji and the monkey park", "Day trip to Nara: Todai-ji and "
        "the deer park", "Kinkaku-ji, Ryoan-ji and a tea ceremony", "Train to Hiroshima, the Peace Memorial "
        "Museum", "Miyajima island and the floating torii at high tide", "Osaka: the castle, then Dotonbori for "
        "street food", "Last shopping in Umeda and fly home from Kansai airport"]),
    ("Describe 16 Python built-in functions briefly.", "Sixteen built-ins worth knowing:", [
        "len() returns the number of items in a container", "range() produces a lazy sequence of integers",
        "enumerate() pairs each item with its index", "zip() walks several iterables in step",
        "sorted() returns a new sorted list from any iterable", "reversed() iterates a sequence backwards",
        "map() applies a function to every item", "filter() keeps the items a predicate accepts",
        "sum() adds numbers, with an optional start value", "min() and max() find the extremes, with key=",
        "any() is true if at least one item is truthy", "all() is true if every item is truthy",
        "isinstance() checks an object's type, including subclasses", "open() opens a file and returns a "
        "file object", "print() writes to standard output", "input() reads a line from standard input"]),
    ("列出中国二十个省份及其省会。", "以下是二十个省份及其省会：", [
        "河北省：石家庄", "山西省：太原", "辽宁省：沈阳", "吉林省：长春", "黑龙江省：哈尔滨", "江苏省：南京", "浙江省：杭州",
        "安徽省：合肥", "福建省：福州", "江西省：南昌", "山东省：济南", "河南省：郑州", "湖北省：武汉", "湖南省：长沙",
        "广东省：广州", "海南省：海口", "四川省：成都", "贵州省：贵阳", "云南省：昆明", "陕西省：西安"]),
]
ENUM_REASONING = "The user wants a list, one item per line. I'll number them and keep each line short and factual."


def _rec(category, user, text, **kw) -> dict:
    return {"category": category, "user": user, "text": text, **kw}


def _bank(i: int) -> tuple[str, tuple[str, str, str]]:
    """The i-th item of the banks in turn: (category, (question, reasoning, answer))."""
    banks = [("chat", CHAT), ("code", CODE), ("reasoning", REASONING), ("chat", ZH)]
    category, bank = banks[i % len(banks)]
    return category, bank[(i // len(banks)) % len(bank)]


# ---- loops ------------------------------------------------------------------------------------------

def loop_one_line(b: Builder) -> None:
    """A sentence repeated dozens of times inside one line; twin: said once."""
    en = ["Wait, let me double-check the units again.", "So the answer should be consistent with that.",
          "I need to make sure the edge case is handled.", "Let me re-read the question carefully.",
          "Hmm, that doesn't look right, let me try again."]
    zh = ["等等，我再检查一下这个结果。", "所以答案应该和前面一致。"]
    for i in range(10):
        category, (q, r, a) = _bank(i)
        s = b.rng.choice(zh if category == "chat" and i % 4 == 3 else en)
        k = b.rng.randint(20, 60)
        sep = "" if s[-1] == "。" else " "
        if i % 2:  # in the reasoning, which is one line already
            bad, good = think(b.vary(r) + sep + sep.join([s] * k), a), think(b.vary(r) + sep + s, a)
        else:
            bad, good = (think(b.vary(r), a + "\n\n" + sep.join([s] * k)), think(b.vary(r), a))
        b.pair("loop_one_line", ("repetition_loop",), _rec(category, q, bad), _rec(category, q, good))


def loop_counter(b: Builder) -> None:
    """Lines identical but for a counter; twin: a numbered enumeration of new content, near the cap."""
    counters = ["Step {n}: Verify the result.", "Day {n}: Review.", "Iteration {n}: the loss is still going "
                "down, so I continue.", "Attempt {n}: try the next value.", "第{n}步：检查结果。",
                "{n}. Same as above.", "Row {n}: no change."]
    for i in range(10):
        q, intro, items = ENUMS[i % len(ENUMS)]
        fmt = counters[i % len(counters)]
        if (fmt[0] == "第") != (q[0] > "\u2e80"):
            fmt = "第{n}步：检查结果。" if q[0] > "\u2e80" else "Step {n}: Verify the result."
        good_list = "\n".join(f"{n}. {item}" for n, item in enumerate(items, 1))
        start = b.rng.randint(3, 6)
        first = "\n".join(f"{n}. {item}" for n, item in enumerate(items[:start], 1))
        loop = "\n".join(fmt.format(n=n) for n in range(start + 1, start + 1 + b.rng.randint(30, 80)))
        if i % 3 == 2:  # the counter loop in the reasoning
            bad = think(ENUM_REASONING + "\n" + loop, f"{intro}\n\n{good_list}")
        else:
            bad = think(b.vary(ENUM_REASONING), f"{intro}\n\n{first}\n{loop}")
        good = think(b.vary(ENUM_REASONING), f"{intro}\n\n{good_list}")
        used = _tokens(good)
        b.pair("loop_counter", ("repetition_loop",), _rec("chat", q, bad),
               _rec("chat", q, good, used=used, cap=used + b.rng.randint(3, 40)))


def loop_near_identical(b: Builder) -> None:
    """Copies with one word changed per copy; twin: `Let me check:` lines with new content, or a table."""
    frames = [("Wait, maybe I should {} the cache before the request, so the response stays consistent.",
               ["clear", "flush", "reset", "invalidate", "refresh"]),
              ("So the total is {} apples, which means every basket holds the same number of apples.",
               ["12", "13", "14", "15"]),
              ("The key point is that the {} must be checked before we return the value.",
               ["index", "length", "pointer", "counter", "offset"]),
              ("Actually, I think the answer is {}. Let me verify this once more.", ["B", "C", "D", "A"]),
              ("所以我们需要先{}缓存，然后再发送请求。", ["清空", "刷新", "重置", "更新"])]
    products = ["Notebook A5", "Gel pen (blue)", "Stapler", "Desk lamp", "USB-C cable 1 m", "Sticky notes",
                "Monitor stand", "Ergonomic mouse", "Paper clips (100)", "Whiteboard marker", "Label printer",
                "Laptop sleeve 14\"", "Highlighter set", "Cable ties", "Mouse pad", "Document tray"]
    for i in range(10):
        category, (q, r, a) = _bank(i)
        frame, words = frames[4] if i % 4 == 3 else frames[i % 4]  # the Chinese one for the Chinese prompt
        copies, last = [], None
        for _ in range(b.rng.randint(15, 40)):
            last = b.rng.choice([w for w in words if w != last])
            copies.append(frame.format(last))
        loop = b.rng.choice(["\n", " ", "\n\n"]).join(copies)
        if i % 2:
            total, checks = b.rng.randint(20, 90), []
            for _ in range(b.rng.randint(10, 20)):
                x = b.rng.randint(3, 99)
                checks.append(f"Let me check: {total} + {x} = {total + x}, "
                              + b.rng.choice(["that matches the receipt.", "carry the one, yes.",
                                              "so the running total is right.", "consistent with the line above.",
                                              "good.", "which agrees with the subtotal."]))
                total += x
            good_r = b.vary(r) + "\n" + "\n".join(checks)
            bad = think(b.vary(r) + "\n" + loop, a)
            good = think(good_r, a)
            b.pair("loop_near_identical", ("repetition_loop",), _rec(category, q, bad), _rec(category, q, good))
        else:
            rows = b.rng.sample(products, 12)
            table = "| Item | Qty | Unit price |\n|---|---|---|\n" + "\n".join(
                f"| {p} | {b.rng.randint(1, 20)} | ${b.rng.randint(1, 80)}.{b.rng.randint(0, 99):02d} |" for p in rows)
            q2 = "Make a table of the office supplies to reorder this month, with quantities and unit prices."
            r2 = "The user wants a table of office supplies with quantity and unit price. I'll make a markdown table."
            bad = think(b.vary(r2), "Here is the reorder list:\n\n" + table + "\n\n" + loop)
            good = think(b.vary(r2), "Here is the reorder list:\n\n" + table + "\n\nPrices are from the last invoice.")
            b.pair("loop_near_identical", ("repetition_loop",), _rec("chat", q2, bad), _rec("chat", q2, good))


def loop_long_block(b: Builder) -> None:
    """A block of more than 8 lines repeated mid-text; twin: a task list whose headings each repeat
    the same checklist lines around new content."""
    blocks = [
        "def handler(event, context):\n    body = json.loads(event[\"body\"])\n    user = body.get(\"user\")\n"
        "    if user is None:\n        return {\"statusCode\": 400}\n    record = table.get_item(Key={\"id\": user})\n"
        "    if \"Item\" not in record:\n        return {\"statusCode\": 404}\n    item = record[\"Item\"]\n"
        "    return {\"statusCode\": 200, \"body\": json.dumps(item)}",
        "- Open the settings page.\n- Click on Accounts.\n- Choose the account to change.\n- Click Edit.\n"
        "- Change the email address.\n- Click Save.\n- Check your inbox for the confirmation.\n"
        "- Click the confirmation link.\n- Sign in again with the new address.",
        "server:\n  port: 8080\n  host: 0.0.0.0\nlogging:\n  level: info\n  format: json\ndatabase:\n"
        "  url: postgres://db:5432/app\n  pool: 10\n  timeout: 30",
        "首先，打开设置页面。\n然后，点击账户管理。\n选择要修改的账户。\n点击编辑按钮。\n修改邮箱地址。\n点击保存。\n"
        "检查收件箱中的确认邮件。\n点击确认链接。\n用新的邮箱重新登录。",
    ]
    asks = [("code", "Write an AWS Lambda handler that returns a user record from DynamoDB.",
             "I'll write a handler that parses the body, validates the user field and fetches the item."),
            ("chat", "How do I change the email address on my account?",
             "The user wants steps to change their account email. A short numbered procedure."),
            ("code", "Give me a sample config.yaml for the service with server, logging and database sections.",
             "A YAML config with three sections; keep defaults sensible."),
            ("chat", "怎么修改账户绑定的邮箱？", "The user asks in Chinese how to change the account email; answer in Chinese "
                                         "with steps.")]
    owners = ["Mina", "Jorge", "Aiko", "Sam", "Priya", "Lukas", "Chen", "Fatima", "Omar", "Elena"]
    tasks = ["Migrate the billing service to Postgres 16", "Add rate limiting to the public API",
             "Replace the cron jobs with the task queue", "Write the onboarding guide for new engineers",
             "Fix flaky integration tests in CI", "Upgrade the frontend to React 19",
             "Set up alerts for the payment webhooks", "Archive the unused S3 buckets",
             "Add dark mode to the dashboard", "Audit third-party dependencies for licences",
             "Cut the cold-start time of the mobile app", "Move secrets into the vault"]
    qt = "Turn our Q2 engineering tasks into a checklist per task (owner, due date, status, the usual gates)."
    rt = "The user wants a per-task checklist with owner, due date, status and the standard gates."
    for i in range(10):
        copies = b.rng.randint(4, 7)
        if i % 2:  # a block said again and again; twin: said once
            j = (i // 2) % len(blocks)
            (category, q, r), block = asks[j], blocks[j]
            fence, end = {0: ("```python\n", "\n```"), 2: ("```yaml\n", "\n```")}.get(j, ("", ""))
            intro, outro = (("步骤如下：", "如果没有收到确认邮件，请检查垃圾邮件文件夹。") if j == 3
                            else ("Here you go:", "Let me know if you need anything adjusted."))
            bad = think(b.vary(r), f"{intro}\n\n{fence}" + "\n".join([block] * copies) + f"{end}\n\n{outro}")
            good = think(b.vary(r), f"{intro}\n\n{fence}{block}{end}\n\n{outro}")
            b.pair("loop_long_block", ("repetition_loop",), _rec(category, q, bad), _rec(category, q, good))
            continue
        sections = []  # one task's section repeated; twin: every task once, the gates under each
        for n, task in enumerate(b.rng.sample(tasks, b.rng.randint(6, 10)), 1):
            sections.append(
                f"### {n}. {task}\n- Owner: {b.rng.choice(owners)}\n- Due: 2025-0{b.rng.randint(3, 9)}-"
                f"{b.rng.randint(10, 28)}\n- Status: {b.rng.choice(['not started', 'in progress', 'blocked', 'in review'])}\n"
                "- [ ] Design reviewed\n- [ ] Tests pass in CI\n- [ ] Docs updated\n- [ ] "
                + b.rng.choice(["Load test at 2x traffic", "Sign-off from security", "Rollback plan written",
                                "Stakeholders told", "Metrics dashboard updated"])
                + "\n- Notes: " + b.rng.choice(["depends on the infra ticket", "needs a second reviewer",
                                                "scope agreed on Monday", "waiting for vendor reply",
                                                "half done on a branch"]))
        at = b.rng.randrange(len(sections) - 1)
        bad = think(b.vary(rt), "## Q2 engineering tasks\n\n" + "\n\n".join(
            sections[:at] + [sections[at]] * copies + sections[at + 1:]))
        good = think(b.vary(rt), "## Q2 engineering tasks\n\n" + "\n\n".join(sections))
        b.pair("loop_long_block", ("repetition_loop",), _rec("chat", qt, bad), _rec("chat", qt, good))


def loop_restart(b: Builder) -> None:
    """The whole answer written again and again; twin: written once."""
    for i in range(8):
        category, (q, r, a) = _bank(i)
        copies = b.rng.randint(3, 6)
        joiner = b.rng.choice(["\n\n", "\n\n---\n\n", "\n"])
        bad = think(b.vary(r), joiner.join([a] * copies))
        b.pair("loop_restart", ("repetition_loop",), _rec(category, q, bad), _rec(category, q, think(b.vary(r), a)))
    # Good repetition beside the rule: a chorus between the verses, a short refrain three times in a row
    chorus = ("Hold the lantern, hold it high,\nwe walk the shore till the tide runs dry,\nand if the night "
              "forgets our names,\nthe morning sings them just the same.")
    verses = ["Salt on the rope and a gull on the mast,\nthe harbour lights are fading fast.",
              "My father's boots and my mother's hands,\nwe mend the nets on the northern sands.",
              "The storm will come and the storm will go,\nthe sea keeps more than we will know."]
    song = "\n\n".join(part for verse in verses for part in (verse, chorus))
    refrain = "Round the mill and round the wheel,"
    rhyme = "\n".join([refrain] * 3 + ["grind the corn and bake the meal."])
    for n, (q, text) in enumerate([("Write a short folk song about fishermen, with a chorus.", song),
                                   ("Write a four-line nursery rhyme about a mill.", rhyme)], 9):
        b.add("loop_restart", "good", (), f"loop_restart-{n}-good",
              _rec("chat", q, think(b.vary("The user wants a short poem. I'll keep the rhythm steady."), text)))


def loop_in_tool_arg(b: Builder) -> None:
    """A loop inside a tool-call argument; twin: a legitimately repetitive argument (rows of data)."""
    names = ["Alice Moreau", "Bilal Khan", "Chiara Rossi", "Dmitri Volkov", "Emeka Obi", "Fiona Walsh", "Goro Sato",
             "Hana Novak", "Ivan Petrov", "Julia Costa", "Kwame Mensah", "Lena Berg", "Mateo Ruiz", "Nora Lind",
             "Oskar Nyberg", "Paula Sousa", "Quinn Reyes", "Ravi Iyer", "Sofia Greco", "Tomas Horak"]
    cities = ["Lyon", "Leeds", "Turin", "Kazan", "Lagos", "Cork", "Osaka", "Brno", "Riga", "Porto", "Accra", "Malmo"]
    for i in range(8):
        kind = i % 4
        if kind == 0:
            q = "Export the customer list to customers.csv (id, name, city, signup date)."
            header = "id,name,city,signup_date"
            rows = [f"{n},{name},{b.rng.choice(cities)},2024-{b.rng.randint(1, 12):02d}-{b.rng.randint(1, 28):02d}"
                    for n, name in enumerate(b.rng.sample(names, 16), 101)]
            loop_row = rows[2]
            bad_args = {"path": "customers.csv", "content": "\n".join([header, *rows[:3], *[loop_row] * b.rng.randint(30, 70)])}
            good_args = {"path": "customers.csv", "content": "\n".join([header, *rows])}
            name, tools = "write_file", ["write_file"]
        elif kind == 1:
            q = "Create a .gitignore for a Python project that also uses Node for the frontend."
            entries = ["__pycache__/", "*.py[cod]", ".venv/", "dist/", "build/", "*.egg-info/", ".pytest_cache/",
                       ".mypy_cache/", "node_modules/", "npm-debug.log*", ".env", ".DS_Store", "coverage/", ".idea/"]
            bad_args = {"path": ".gitignore", "content": "\n".join(entries[:5] + ["node_modules/"] * b.rng.randint(40, 90))}
            good_args = {"path": ".gitignore", "content": "\n".join(entries)}
            name, tools = "write_file", ["write_file"]
        elif kind == 2:
            q = "Search for reviews of the Framework Laptop 16."
            phrase = "Framework Laptop 16 review"
            bad_args = {"query": " ".join([phrase] * b.rng.randint(20, 50))}
            good_args = {"query": f"{phrase} battery life thermals 2025", "max_results": 8}
            name, tools = "search_web", ["search_web"]
        else:
            q = "Pull the open tickets for the accounts I care about from the DB."
            ids = b.rng.sample(range(1000, 9999), 24)
            bad_args = {"query": "SELECT * FROM tickets WHERE status = 'open' AND (account_id = 4411"
                        + " OR account_id = 4411" * b.rng.randint(40, 90) + ");"}
            good_args = {"query": "SELECT * FROM tickets WHERE status = 'open' AND account_id IN ("
                         + ", ".join(map(str, ids)) + ");", "limit": 200}
            name, tools = "run_sql", ["run_sql"]
        r = f"The user wants me to use {name}. I'll prepare the arguments and call it."
        b.pair("loop_in_tool_arg", ("repetition_loop",),
               _rec("tool", q, think(b.vary(r), xml_call(name, **bad_args)), tools=tools),
               _rec("tool", q, think(b.vary(r), xml_call(name, **good_args)), tools=tools))
    # Good arguments that repeat a span within one line: a staircase path, base64 with zero runs, a
    # vector of zeros, a table's rule
    stairs = '<svg xmlns="http://www.w3.org/2000/svg"><path d="M0 0 ' + "h10 v10 " * 40 + 'z"/></svg>'
    png = "iVBORw0KGgoAAAANSUhEUgAAAEAAAABACAYAAACqaXHeAAAA" + "A" * 300 + "SUVORK5CYII="
    zeros = json.dumps({"name": "bias_init", "values": [0.0] * 96})
    table = "| " + " | ".join(f"col{i}" for i in range(24)) + " |\n|" + "---|" * 24
    for n, (q, path, content) in enumerate([
            ("Draw a staircase as an SVG and save it.", "stairs.svg", stairs),
            ("Save this 64x64 transparent PNG (base64) as blank.b64.", "blank.b64", png),
            ("Write the initial bias vector to bias.json.", "bias.json", zeros),
            ("Create an empty 24-column markdown table in table.md.", "table.md", table)], 9):
        r = "The user wants a file written. I'll call write_file with the content."
        b.add("loop_in_tool_arg", "good", (), f"loop_in_tool_arg-{n}-good",
              _rec("tool", q, think(b.vary(r), xml_call("write_file", path=path, content=content)), tools=["write_file"]))


# ---- tool calls -------------------------------------------------------------------------------------

def _call_rec(b: Builder, user: str, reasoning: str, answer: str, tools: list[str], model: str = QWEN36) -> dict:
    return _rec("tool", user, think(b.vary(reasoning), answer), tools=tools, model=model)


def tool_param_cut(b: Builder) -> None:
    """A literal </parameter> inside a value (XML-ish file contents) cuts it; twin: contents that only
    look alike (</parameters>, <param>, a self-closing <parameter/>)."""
    files = [  # (path, contents holding </parameter>, the same file without it)
        ("docs/max.xml", "<funcsynopsis>\n  <funcprototype>\n    <funcdef>int <function>max</function></funcdef>\n"
         "    <paramdef>int <parameter>a</parameter></paramdef>\n    <paramdef>int <parameter>b</parameter></paramdef>\n"
         "  </funcprototype>\n</funcsynopsis>",
         # not DocBook's <function>max</function>: a literal </function> cuts the call in SGLang's parser too
         "<funcsynopsis>\n  <funcprototype>\n    <funcdef>int <emphasis>max</emphasis></funcdef>\n"
         "    <paramdef>int <replaceable>a</replaceable></paramdef>\n    <paramdef>int <replaceable>b</replaceable>"
         "</paramdef>\n  </funcprototype>\n</funcsynopsis>"),
        ("ci/job.xml", "<job>\n  <parameters>\n    <parameter name=\"branch\">main</parameter>\n"
         "    <parameter name=\"retries\">3</parameter>\n  </parameters>\n</job>",
         "<job>\n  <parameters>\n    <param name=\"branch\">main</param>\n    <param name=\"retries\">3</param>\n"
         "  </parameters>\n</job>"),
        ("reports/sales.jrxml", "<jasperReport name=\"sales\">\n  <parameter name=\"ReportTitle\" class=\"java.lang."
         "String\">\n    <defaultValueExpression><![CDATA[\"Sales\"]]></defaultValueExpression>\n  </parameter>\n"
         "  <field name=\"amount\" class=\"java.math.BigDecimal\"/>\n</jasperReport>",
         "<jasperReport name=\"sales\">\n  <parameter name=\"ReportTitle\" class=\"java.lang.String\"/>\n"
         "  <field name=\"amount\" class=\"java.math.BigDecimal\"/>\n</jasperReport>"),
        ("plugin.xml", "<plugin id=\"export\">\n  <action name=\"csv\">\n    <parameter key=\"delimiter\">;</parameter>\n"
         "    <parameter key=\"quote\">\"</parameter>\n  </action>\n</plugin>",
         "<plugin id=\"export\">\n  <action name=\"csv\">\n    <option key=\"delimiter\">;</option>\n"
         "    <option key=\"quote\">\"</option>\n  </action>\n</plugin>"),
    ]
    for i in range(8):
        path, cut, whole = files[i % len(files)]
        if i >= len(files):
            path = "src/main/resources/" + path.rsplit("/", 1)[-1]
        q = f"Create {path} with the structure we discussed."
        r = f"The user wants {path} written. I'll write the XML with write_file."
        b.pair("tool_param_cut", ("tool_bad_xml",),
               _call_rec(b, q, r, xml_call("write_file", path=path, content=cut), ["write_file"]),
               _call_rec(b, q, r, xml_call("write_file", path=path, content=whole), ["write_file"]))


def _request(i: int) -> tuple[str, str, str, dict, str]:
    return TOOL_REQUESTS[i % len(TOOL_REQUESTS)]


def _lead(preface: str) -> str:
    return f"{preface}\n\n" if preface else ""


def tool_name_space(b: Builder) -> None:
    """A function name with a trailing space (the parsers keep it: no offered tool has that name)."""
    for i in range(8):
        q, r, name, args, pre = _request(i)
        if i % 4 == 3:  # a Qwen3 (Hermes) model
            bad = hermes_call(name + " ", args)
            good = hermes_call(name, args)
            model = QWEN3
        else:
            bad = xml_call(name, **args).replace(f"<function={name}>", f"<function={name} >")
            good = xml_call(name, **args)
            model = QWEN36
        b.pair("tool_name_space", ("tool_unknown_name", "tool_bad_xml", "tool_bad_json"),
               _call_rec(b, q, r, _lead(pre) + bad, [name], model), _call_rec(b, q, r, _lead(pre) + good, [name], model))


def tool_nan_hermes(b: Builder) -> None:
    """NaN or Infinity in a Hermes call's JSON (Python's json reads it; JSON has no such value)."""
    asks = [("Alert me if TSLA drops below 180.", "set_alert", '{"symbol": "TSLA", "threshold": NaN, "direction": "below"}',
             {"symbol": "TSLA", "threshold": 180, "direction": "below"}),
            ("Set an alert for BTC-USD above 100k.", "set_alert", '{"symbol": "BTC-USD", "threshold": Infinity, "direction": "above"}',
             {"symbol": "BTC-USD", "threshold": 100000, "direction": "above"}),
            ("Weather in Oslo for the week?", "get_weather", '{"city": "Oslo", "days": NaN}', {"city": "Oslo", "days": 7}),
            ("Give me the top results on rust async runtimes.", "search_web",
             '{"query": "rust async runtimes comparison", "max_results": NaN}',
             {"query": "rust async runtimes comparison", "max_results": 10}),
            ("Tell me when MSFT goes under 300.", "set_alert", '{"symbol": "MSFT", "threshold": -Infinity, "direction": "below"}',
             {"symbol": "MSFT", "threshold": 300, "direction": "below"})]
    for i in range(8):
        q, name, bad_args, good_args = asks[i % len(asks)]
        if i >= len(asks):
            q = q.rstrip("?.") + ", please."
        r = f"The user wants {name}. I'll call it with the values from the request."
        b.pair("tool_nan_hermes", ("tool_bad_json",),
               _call_rec(b, q, r, hermes_call(name, bad_args), [name], QWEN3),
               _call_rec(b, q, r, hermes_call(name, good_args), [name], QWEN3))


def tool_duplicate_call(b: Builder) -> None:
    """The same call (name and arguments) twice in one answer; twin: parallel calls that differ."""
    asks = [("Compare the weather in Paris and Rome tomorrow.", "get_weather", {"city": "Paris", "days": 1},
             {"city": "Rome", "days": 1}),
            ("What are NVDA and AMD trading at?", "get_stock_price", {"symbol": "NVDA"}, {"symbol": "AMD"}),
            ("Search for both 'vector databases' and 'pgvector benchmarks'.", "search_web",
             {"query": "vector databases"}, {"query": "pgvector benchmarks"}),
            ("Set alerts on AAPL above 250 and below 200.", "set_alert",
             {"symbol": "AAPL", "threshold": 250, "direction": "above"},
             {"symbol": "AAPL", "threshold": 200, "direction": "below"}),
            ("明天东京和大阪的天气怎么样？", "get_weather", {"city": "Tokyo", "days": 1}, {"city": "Osaka", "days": 1})]
    for i in range(8):
        q, name, first, second = asks[i % len(asks)]
        r = f"Two lookups are needed; I can call {name} for both in parallel."
        n_dup = 2 if i < 5 else 3
        bad = "\n".join([xml_call(name, **first)] * n_dup) if i % 2 == 0 else \
            "\n".join([xml_call(name, **first), xml_call(name, **second), xml_call(name, **second)])
        good = "\n".join([xml_call(name, **first), xml_call(name, **second)])
        b.pair("tool_duplicate_call", ("tool_duplicate_call",),
               _call_rec(b, q, r, bad, [name]), _call_rec(b, q, r, good, [name]))


def tool_param_twice(b: Builder) -> None:
    """A parameter given twice in one call (the parser keeps only the last)."""
    for i in range(8):
        q, r, name, args, pre = _request(i)
        key = next(iter(args))
        other = {"city": "Porto", "query": "solid-state battery", "to": "priya@example.org", "symbol": "NVDA.US",
                 "title": "Sync", "path": "docs/README.md"}.get(key, "x")
        good = xml_call(name, **args)
        dup = f"<parameter={key}>\n{other if i % 2 else args[key]}\n</parameter>\n"
        bad = good.replace("</function>", dup + "</function>") if i % 3 else good.replace(f"<function={name}>\n", f"<function={name}>\n{dup}")
        b.pair("tool_param_twice", ("tool_bad_xml",),
               _call_rec(b, q, r, _lead(pre) + bad, [name]), _call_rec(b, q, r, _lead(pre) + good, [name]))


def tool_call_unparsed(b: Builder) -> None:
    """A call the model's parser does not read: Hermes JSON from Qwen3.6, XML from Qwen3, a fenced
    JSON block naming an offered tool; twin: the call in the model's format."""
    for i in range(10):
        q, r, name, args, pre = _request(i)
        kind = i % 3
        if kind == 0:
            model, bad, good = QWEN36, hermes_call(name, args), xml_call(name, **args)
        elif kind == 1:
            model, bad, good = QWEN3, xml_call(name, **args), hermes_call(name, args)
        else:
            model, good = QWEN36, xml_call(name, **args)
            bad = "```json\n" + json.dumps({"name": name, "arguments": args}, indent=2, ensure_ascii=False) + "\n```"
        b.pair("tool_call_unparsed", ("tool_call_unparsed",),
               _call_rec(b, q, r, _lead(pre) + bad, [name], model), _call_rec(b, q, r, _lead(pre) + good, [name], model))


def tool_response_invented(b: Builder) -> None:
    """The model writes the tool's <tool_response> itself and answers from it; twin: it stops at the call."""
    results = {"get_weather": ('{"city": "Lisbon", "forecast": [{"day": 1, "high": 21, "low": 14}, {"day": 2, "high": '
                               '22, "low": 15}, {"day": 3, "high": 19, "low": 13}]}',
                               "Lisbon will be mild: highs of 19-22 °C and lows around 13-15 °C over the next three days."),
               "search_web": ('[{"title": "Solid-state batteries near production", "url": "https://example.com/ssb"}]',
                              "I found a recent piece saying solid-state batteries are close to production."),
               "run_sql": ('[{"day": "2025-03-03", "orders": 412}, {"day": "2025-03-04", "orders": 389}]',
                           "Last week you had 412 orders on Monday and 389 on Tuesday."),
               "send_email": ('{"status": "sent", "id": "msg_8812"}', "Done: the email to Priya has been sent."),
               "get_stock_price": ('{"symbol": "NVDA", "price": 131.42, "currency": "USD"}',
                                   "NVIDIA (NVDA) is trading at $131.42."),
               "create_event": ('{"id": "evt_19", "status": "confirmed"}', "The sync is on your calendar for 10:00."),
               "write_file": ('{"ok": true, "bytes": 96}', "README.md has been written."),
               "set_alert": ('{"alert_id": 77, "active": true}', "Your alert on AAPL above 250 is set.")}
    for i in range(8):
        q, r, name, args, pre = _request(i)
        result, summary = results[name]
        call = _lead(pre) + xml_call(name, **args)
        sep = b.rng.choice(["\n", "\n\n"])
        bad = f"{call}{sep}<tool_response>\n{result}\n</tool_response>\n\n{summary}" if i % 2 == 0 else \
            f"{call}\n<tool_response>\n{result}\n</tool_response>"
        b.pair("tool_response_invented", ("tool_response_invented",),
               _call_rec(b, q, r, bad, [name]), _call_rec(b, q, r, call, [name]))


def tool_typing(b: Builder) -> None:
    """Number-looking values of properties the parsers keep as strings (anyOf [string, null],
    anyOf [string, integer], no type); bad twin: a required one left out."""
    asks = [("Look up 500 Howard St, ZIP 94105.", "lookup_address", {"street": "500 Howard St", "zip_code": "94105"}),
            ("Find 77 Massachusetts Ave, Cambridge, zip 02139.", "lookup_address",
             {"street": "77 Massachusetts Ave", "zip_code": "02139"}),
            ("Where's order 10045?", "get_order", {"order_id": "10045"}),
            ("Status of order 000731 please.", "get_order", {"order_id": "000731"}),
            ("Tag item 4471 as 'clearance'.", "tag_item", {"item": "4471", "tag": "clearance"}),
            ("Tag catalogue item 0092 with 'new'.", "tag_item", {"item": "0092", "tag": "new"}),
            ("Look up 1600 Amphitheatre Pkwy, 94043.", "lookup_address",
             {"street": "1600 Amphitheatre Pkwy", "zip_code": "94043"}),
            ("Check order 3.", "get_order", {"order_id": "3"})]
    for i, (q, name, args) in enumerate(asks):
        r = f"I'll call {name} with the values the user gave, as written."
        missing = dict(list(args.items())[1:]) if len(args) > 1 else {}
        bad = xml_call(name, **missing) if missing else f"<tool_call>\n<function={name}>\n</function>\n</tool_call>"
        b.pair("tool_typing", ("tool_missing_required",),
               _call_rec(b, q, r, bad, [name]), _call_rec(b, q, r, xml_call(name, **args), [name]))


# ---- text -------------------------------------------------------------------------------------------

def control_token_text(b: Builder) -> None:
    """Qwen's control tokens written as text; twin: lookalikes that are no special ids of its tokenizer."""
    chat_fmt = ("Explain how a chat conversation is laid out as text for the model.",
                "The user asks how chat turns are serialised. I'll show the markup of one exchange.")
    for i in range(10):
        kind = i % 5
        if kind in (0, 1):  # the model runs on past its turn: an end token, then a user turn of its own
            category, (q, r, a) = _bank(i)
            tail = b.rng.choice(["<|im_end|>\n<|im_start|>user\nThanks, that helps!",
                                 "<|im_end|>\n<|im_start|>user\nCan you give another example?<|im_end|>\n<|im_start|>assistant\nSure.",
                                 "<|endoftext|>Human: what about the next one?"])
            b.pair("control_token_text", ("control_token_text",),
                   _rec(category, q, think(b.vary(r), f"{a}{tail}")), _rec(category, q, think(b.vary(r), a)))
        elif kind == 2:  # the ChatML markup itself written out, or a lookalike format
            q, r = chat_fmt
            bad = ("Each turn is wrapped in start and end markers:\n\n```\n<|im_start|>system\nYou are a helpful "
                   "assistant.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\nHello! How can I help?"
                   "<|im_end|>\n```\n\nThe model generates the assistant part and stops at the end marker.")
            good = ("Each turn is wrapped in markers; in Phi-3's format, for example:\n\n```\n<|system|>\nYou are a "
                    "helpful assistant.<|end|>\n<|user|>\nHi!<|end|>\n<|assistant|>\nHello! How can I help?<|end|>\n"
                    "```\n\nThe model generates the assistant part and stops at the end marker.")
            b.pair("control_token_text", ("control_token_text",), _rec("chat", q, think(b.vary(r), bad)),
                   _rec("chat", q, think(b.vary(r), good)))
        elif kind == 3:  # a document-separator token inside an answer
            category, (q, r, a) = _bank(i + 1)
            cut = a.find("\n\n") if "\n\n" in a else len(a) // 2
            bad = a[:cut] + "<|endoftext|>" + a[cut:]
            good = a
            b.pair("control_token_text", ("control_token_text",), _rec(category, q, think(b.vary(r), bad)),
                   _rec(category, q, think(b.vary(r), good)))
        else:  # a prompt template for another model family, in code
            q = "Write Python f-strings that format a single-turn prompt for Llama 3 and for one more model family."
            r = "I'll write the two templates as f-strings with the models' markup."
            bad = ("```python\nllama3 = f\"<|begin_of_text|><|start_header_id|>user<|end_header_id|>\\n\\n{msg}"
                   "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\\n\\n\"\nqwen = f\"<|im_start|>user\\n{msg}"
                   "<|im_end|>\\n<|im_start|>assistant\\n\"\n```\n\nIn practice, prefer `tokenizer.apply_chat_template`.")
            good = ("```python\nllama3 = f\"<|begin_of_text|><|start_header_id|>user<|end_header_id|>\\n\\n{msg}"
                    "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\\n\\n\"\nphi3 = f\"<|user|>\\n{msg}<|end|>\\n"
                    "<|assistant|>\\n\"\n```\n\nFor Qwen, use `tokenizer.apply_chat_template`: it writes the markup for you.")
            bad = bad if i < 5 else bad.replace("prefer", "always prefer")
            good = good if i < 5 else good.replace("For Qwen", "For Qwen models")
            b.pair("control_token_text", ("control_token_text",), _rec("code", q, think(b.vary(r), bad)),
                   _rec("code", q, think(b.vary(r), good)))


def stray_think_in_reasoning(b: Builder) -> None:
    """A <think> opened again inside the reasoning; twin: the same reasoning without it."""
    second = ["Wait, let me reconsider whether I missed something in the question.",
              "Actually, let me double-check the key fact before answering.",
              "Hmm, one more consideration: keep it practical for the user.",
              "让我再确认一下关键的事实。"]
    for i in range(8):
        category, (q, r, a) = _bank(i)
        more = second[3] if i % 4 == 3 else b.rng.choice(second[:3])
        sep = b.rng.choice(["\n\n<think>\n", "\n<think>\n", " <think> "])
        b.pair("stray_think_in_reasoning", ("stray_think",),
               _rec(category, q, think(b.vary(r) + sep + more, a)),
               _rec(category, q, think(b.vary(r) + "\n\n" + more, a)))


def tags_quoted_in_code(b: Builder) -> None:
    """Think and tool-call tags quoted inside fenced code, no tools offered (good); bad twin: the tag
    loose in the answer."""
    asks = [("Write a Python function that removes the reasoning block from a Qwen output string.",
             "Strip everything up to and including the closing think tag with a regex or split.",
             "```python\nimport re\n\nTHINK = re.compile(r\"<think>.*?</think>\\s*\", re.DOTALL)\n\n\ndef strip_reasoning("
             "text: str) -> str:\n    return THINK.sub(\"\", text)\n```\n\nIt removes a `<think>...</think>` block "
             "and the whitespace after it.", "stray_think"),
            ("What does Qwen3.6's raw output look like when it calls a tool?",
             "The user asks about the raw format of a Qwen3.6 tool call. Show an example in a code block.",
             "The call comes after the reasoning, in an XML-like block:\n\n```\n<tool_call>\n<function=get_weather>\n"
             "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n```\n\nThe server's `qwen3_coder` "
             "parser turns it into a JSON tool call.", "tool_without_tools"),
            ("How do I split the reasoning from the answer in a Qwen3 completion in JavaScript?",
             "Split at the first closing think tag. Show JS.",
             "```javascript\nfunction splitReasoning(text) {\n  const end = text.indexOf(\"</think>\");\n  if (end === -1) "
             "return { reasoning: text, content: \"\" };\n  return { reasoning: text.slice(0, end), content: "
             "text.slice(end + \"</think>\".length) };\n}\n```", "stray_think"),
            ("Show me a Hermes-style tool call for a function get_time with a timezone argument.",
             "The Hermes format puts a JSON object inside tool_call tags. Show it in a code block.",
             "In the Hermes format the call is a JSON object between the tags:\n\n```\n<tool_call>\n{\"name\": "
             "\"get_time\", \"arguments\": {\"timezone\": \"Europe/Berlin\"}}\n</tool_call>\n```\n\nOne object per "
             "call; several calls are written one after another.", "tool_without_tools")]
    for i in range(8):
        q, r, good, code = asks[i % len(asks)]
        # the same answer with its code fences lost: the tags now stand in the answer itself
        bad = good.replace("```python\n", "").replace("```javascript\n", "").replace("```\n", "").replace("\n```", "")
        if i >= len(asks):
            good, bad = good + "\n\nHope this helps.", bad + "\n\nHope this helps."
        b.pair("tags_quoted_in_code", (code,), _rec("code", q, think(b.vary(r), bad)),
               _rec("code", q, think(b.vary(r), good)))


def language_drift(b: Builder) -> None:
    """An English prompt whose answer drifts into Chinese (and the reverse); twin: the other language
    asked for (translate, "also in Chinese"), or kept."""
    drift = [("Why is the sky blue?", 2, "简单来说，空气分子对短波长的蓝光散射得更强，所以我们从各个方向看到的都是蓝色。日落时光线穿过更厚的大气层，"
              "蓝光被散射掉，剩下红色和橙色。"),
             ("What are some tips for sleeping better?", 4, "另外，睡前一小时尽量不要看手机，屏幕的蓝光会抑制褪黑素的分泌，让人更难入睡。"
              "如果长期失眠，建议咨询医生。"),
             ("Explain what an index fund is to a teenager.", 5, "总的来说，指数基金适合长期投资，不需要你去挑选个股，"
              "费用也比较低。"),
             ("Is it safe to leave cooked rice out overnight?", 7, "所以，隔夜放在室温下的米饭最好不要吃，"
              "即使重新加热也不能保证安全。"),
             ("What's the difference between a latte and a cappuccino?", 0, "拿铁的牛奶更多，口感更柔和；卡布奇诺的奶泡更厚，"
              "咖啡味更浓。")]
    by_q = {q: (r, a) for q, r, a in CHAT}
    for i in range(10):
        if i >= 8:  # a Chinese prompt whose answer drifts into an English paragraph
            q, r, a = ZH[i - 8]
            en = ("In short, the most important thing is consistency: practice a little every day rather than a lot "
                  "once a week, and keep track of your progress." if i == 8 else
                  "To summarise, overfitting means the model memorises noise in the training data instead of learning "
                  "the general pattern, so it fails on new data.")
            b.pair("language_drift", ("language_drift",), _rec("chat", q, think(b.vary(r), f"{a}\n\n{en}")),
                   _rec("chat", q, think(b.vary(r), a)))
            continue
        q, _, zh = drift[i % len(drift)]
        r, a = by_q[q]
        bad = think(b.vary(r), f"{a}\n\n{zh}")
        if i % 2:  # the Chinese paragraph asked for
            ask = b.rng.choice([" Then add a one-paragraph summary in Chinese.", " Also give a short summary in "
                                "Chinese (简体中文) at the end.", " End with a Chinese translation of the key point."])
            b.pair("language_drift", ("language_drift",), _rec("chat", q, bad),
                   _rec("chat", q + ask, think(b.vary(r) + " They also want a short Chinese summary.", f"{a}\n\n{zh}")))
        else:  # the same answer kept in English
            b.pair("language_drift", ("language_drift",), _rec("chat", q, bad), _rec("chat", q, think(b.vary(r), a)))
    for i in range(4):  # translations asked for: the prompt in English, the answer in Chinese
        src = ["The meeting has been moved to Thursday afternoon. Please bring the quarterly report.",
               "Our store opens at nine and closes at six on weekdays.",
               "Please keep your luggage with you at all times.",
               "The library will be closed next Monday for maintenance."][i]
        zh_t = ["会议已改到周四下午。请带上季度报告。", "我们的商店工作日早上九点开门，晚上六点关门。", "请随时看管好您的行李。",
                "图书馆下周一因维护闭馆。"][i]
        q = f"Translate into Chinese: {src}"
        r = "A straightforward translation into simplified Chinese; keep the tone neutral and natural."
        bad_q = f"Rewrite this more formally: {src}"
        b.pair("language_drift", ("language_drift",),
               _rec("chat", bad_q, think(b.vary("The user wants a more formal English version."), zh_t)),
               _rec("chat", q, think(b.vary(r), zh_t)))


def thinking_in_answer(b: Builder) -> None:
    """The answer starts reasoning again; twin: the answer alone."""
    openers = ["Okay, the user is asking {}. Let me think about this.", "Okay, so the question is {}. Let me think.",
               "Let me think about this. The user wants to know {}.", "Alright, the user asked {}. First, I need to "
               "figure out what they really need.", "嗯，用户问的是{}。让我想一想。"]
    topics = {"chat": "about something practical", "code": "for a piece of code", "reasoning": "a math question"}
    for i in range(10):
        category, (q, r, a) = _bank(i)
        zh = i % 4 == 3
        opener = openers[4].format("这个问题") if zh else b.rng.choice(openers[:4]).format(topics[category])
        bad = think(b.vary(r), f"{opener} {r}\n\n{a}" if i % 2 else f"{opener}\n\n{a}")
        good_a = a if i % 3 else b.rng.choice(["Sure! ", "Good question. ", "Here's the short version: "]) + a
        b.pair("thinking_in_answer", ("thinking_in_answer",), _rec(category, q, bad),
               _rec(category, q, think(b.vary(r), good_a)))


def stub_answer(b: Builder) -> None:
    """An answer that only points at the reasoning; twin: the short answer itself."""
    stubs = ["See my reasoning above.", "The answer is in my reasoning above.", "As computed above.",
             "(See the analysis above.)", "I've worked it out above.", "答案见上面的推理。"]
    for i in range(8):
        q, r, a = REASONING[i % len(REASONING)] if i % 4 != 3 else ZH[4]
        stub = stubs[5] if i % 4 == 3 else stubs[i % 5]
        b.pair("stub_answer", ("stub_answer",), _rec("reasoning", q, think(b.vary(r), stub)),
               _rec("reasoning", q, think(b.vary(r), a)))


def truncated_stop(b: Builder) -> None:
    """finish_reason stop although the generation was cut: at max_tokens, or inside an open code
    fence mid-line; twin: the whole answer (under the cap, the fence closed)."""
    for i in range(16):
        if i % 2:  # cut inside the code
            q, r, a = CODE[(i // 2) % len(CODE)]
            start = a.index("```") + 3
            end = a.index("\n```", start)
            cut = b.rng.randint(start + 20, end - 5)
            bad = _rec("code", q, think(b.vary(r), a[:cut]))
            good = _rec("code", q, think(b.vary(r), a))
        else:  # the token cap reached, finish stop
            category, (q, r, a) = _bank(i // 2)
            cut = b.rng.randint(len(a) // 2, len(a) - 10)
            text = think(b.vary(r), a[:cut])
            cap = b.rng.choice([256, 384, 512, 1024])
            used = max(cap, _tokens(text))
            bad = _rec(category, q, text, used=used, cap=used)
            good_text = think(b.vary(r), a)
            good = _rec(category, q, good_text, used=_tokens(good_text), cap=used + 512)
        b.pair("truncated_stop", ("truncated_stop",), bad, good)


def duplicate_completion(b: Builder) -> None:
    """The same completion attached to an unrelated prompt later in the shard; twin (first): the
    original, on its own prompt."""
    for i in range(8):
        category, (q, r, a) = _bank(i + 3)
        _, (other, _, _) = _bank(i + 6)
        text = think(b.vary(r), a)
        n = b.count["duplicate_completion"] = b.count.get("duplicate_completion", 0) + 1
        b.add("duplicate_completion", "good", (), f"duplicate_completion-{n}-good", _rec(category, q, text))
        b.add("duplicate_completion", "bad", ("duplicate_completion",), f"duplicate_completion-{n}-bad",
              _rec(category, other, text))


def short_answer(b: Builder) -> None:
    """A very short correct answer after real reasoning (good); bad twin: no reasoning at all."""
    asks = [("2+2?", "Simple arithmetic: 2 plus 2 is 4. Nothing tricky here, the user just wants the number.", "4"),
            ("Capital of Japan?", "The capital of Japan is Tokyo; it has been the seat of government since 1868.",
             "Tokyo."),
            ("Is 17 prime?", "17 is only divisible by 1 and 17: not by 2, 3 (1+7=8), or any prime up to 4. So yes.",
             "Yes."),
            ("What's 15% of 80?", "15% of 80 = 0.15 × 80 = 12. Check: 10% is 8, 5% is 4, total 12.", "12"),
            ("How many legs does a spider have?", "Spiders are arachnids, which have eight legs, unlike insects with six.",
             "8"),
            ("1公里等于多少米？", "1 kilometre is 1000 metres by definition of the metric prefix kilo.", "1000米。"),
            ("Spell 'necessary' backwards.", "necessary: n-e-c-e-s-s-a-r-y. Reversed: y-r-a-s-s-e-c-e-n.", "yrassecen"),
            ("Boiling point of water at sea level in °F?", "100 °C = 100 × 9/5 + 32 = 212 °F.", "212 °F")]
    for q, r, a in asks:
        b.pair("short_answer", ("empty_reasoning", "trivial"), _rec("reasoning", q, think("", a)),
               _rec("reasoning", q, think(b.vary(r), a)))


# ---- ordinary records, their bad twins under the older checks -----------------------------------------

def ordinary(b: Builder) -> None:
    for i in range(8):  # chat: cut at the cap (finish length); some without thinking
        category, (q, r, a) = _bank(4 * (i % len(CHAT)))
        cut = b.rng.randint(len(a) // 3, len(a) - 20)
        if i % 4 == 3:
            bad, good = a[:cut], a
            b.pair("ordinary_chat", ("finish_length",), _rec("chat", q, bad, finish="length", thinking=False,
                                                               used=512, cap=512), _rec("chat", q, good, thinking=False))
        else:
            bad = think(b.vary(r), a[:cut])
            b.pair("ordinary_chat", ("finish_length",), _rec("chat", q, bad, finish="length", used=1024, cap=1024),
                   _rec("chat", q, think(b.vary(r), a)))
    for i in range(6):  # code: the reasoning never closed
        q, r, a = CODE[i]
        bad = b.vary(r) + " " + b.rng.choice(["Let me write the code.", "Now the code:", "I'll write it out."]) + "\n\n" + a
        b.pair("ordinary_code", ("no_think_close", "empty_answer"), _rec("code", q, bad), _rec("code", q, think(b.vary(r), a)))
    for i in range(6):  # reasoning: nothing after </think>
        q, r, a = REASONING[i]
        b.pair("ordinary_reasoning", ("empty_answer",), _rec("reasoning", q, think(b.vary(r), "")),
               _rec("reasoning", q, think(b.vary(r), a)))
    for i in range(6):  # Chinese: a replacement character from a bad decode
        q, r, a = ZH[i]
        at = b.rng.randint(5, len(a) - 5)
        b.pair("ordinary_zh", ("encoding",), _rec("chat", q, think(b.vary(r), a[:at] + "\ufffd" + a[at + 1:])),
               _rec("chat", q, think(b.vary(r), a)))
    # a string where the schema wants an integer or an enum (the parsers keep a string-typed value as
    # written, so only those types make a wrong-type argument)
    wrong = {"get_weather": {"days": "three"}, "run_sql": {"limit": "all"}, "set_alert": {"direction": "sideways"},
             "create_event": {"duration_minutes": "half an hour"}, "search_web": {"max_results": "ten"}}
    for i in range(8):  # tool: a tool not offered, or an argument of the wrong type
        q, r, name, args, pre = _request(i)
        if name in wrong:
            bad, codes = xml_call(name, **{**args, **wrong[name]}), ("tool_args_schema",)
        else:
            bad, codes = xml_call(name + "_v2", **args), ("tool_unknown_name",)
        b.pair("ordinary_tool", codes, _call_rec(b, q, r, _lead(pre) + bad, [name]),
               _call_rec(b, q, r, _lead(pre) + xml_call(name, **args), [name]))

SHAPES = (loop_one_line, loop_counter, loop_near_identical, loop_long_block, loop_restart, loop_in_tool_arg,
          tool_param_cut, tool_name_space, tool_nan_hermes, tool_duplicate_call, tool_param_twice, tool_call_unparsed,
          tool_response_invented, tool_typing, control_token_text, stray_think_in_reasoning, tags_quoted_in_code,
          language_drift, thinking_in_answer, stub_answer, truncated_stop, duplicate_completion, short_answer, ordinary)


def cases(seed: int = 43) -> list[tuple[str, str, tuple[str, ...], dict]]:
    """Every labelled case, in the order they are judged (one shard)."""
    b = Builder(seed)
    for shape in SHAPES:
        shape(b)
    return b.cases


def verdicts(all_cases: list, cfg: dict | None = None) -> dict[str, tuple[list[str], list[str]]]:
    """(reasons, flags) per record id, judged by the validate stage itself (``validate_for_target``) under
    ``cfg``: by default the running code's schema defaults, so codes it does not know are simply
    absent. Each case is a shard of its own, but the twins of ``duplicate_completion``, which share
    one (the original first): a check may look at earlier records of the shard, and one case must
    not decide another's. A shard the stage fails on gets the reason "validate failed: <error>"."""
    cfg = cfg or defaults("validate")
    shards: dict[str, list[dict]] = defaultdict(list)
    for shape, _, _, rec in all_cases:
        shards[rec["id"].rsplit("-", 1)[0] if shape == "duplicate_completion" else rec["id"]].append(rec)
    judged = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n, records in enumerate(shards.values()):
            d = Path(tmp) / str(n)
            d.mkdir()
            write_jsonl_zst(d / "shard-00000.jsonl.zst", records)
            paths = (d / "shard-00000.jsonl.zst", d / "v.jsonl.zst", d / "r.jsonl.zst", d / "qa.json")
            # A Hermes model's run (Qwen3) names its tool-call format; the Qwen3.6 cases' comes from
            # the target, a real Qwen tokenizer and template (the demo target's: XML calls), which
            # gives the special tokens too. Older code has no target to read.
            shard_cfg = {**cfg, "tool_format": "json"} if records[0]["generation"]["model"] == QWEN3 else cfg
            try:
                # validate_job before issue 47 took what validate_for_target takes now
                if job := getattr(stage, "validate_for_target", None) or getattr(stage, "validate_job", None):
                    job(*paths, shard_cfg, None, DEMO_TARGET)
                else:
                    stage.validate_shard(*paths, shard_cfg)
            except Exception as e:  # noqa: BLE001 - a stage failing on a case is one of the figures
                judged.update({rec["id"]: ([f"validate failed: {type(e).__name__}: {e}"], []) for rec in records})
                continue
            judged.update({rec["id"]: (rec["qa"].get("reasons", []), rec["qa"]["flags"])
                           for name in ("v.jsonl.zst", "r.jsonl.zst") for rec in iter_jsonl(d / name)})
    return judged


def outcome(label: str, codes: tuple[str, ...], reasons: list[str], flags: list[str]) -> str:
    """caught / other_code / flagged / missed for a bad case; kept / rejected for a good one."""
    if label == "good":
        return "rejected" if reasons else "kept"
    if set(codes) & set(reasons):
        return "caught"
    if reasons:
        return "other_code"
    return "flagged" if set(codes) & set(flags) else "missed"


def scores(all_cases: list, judged: dict) -> dict:
    """Per shape and overall: counts of each outcome, recall (bad cases rejected with an expected
    code), precision (rejected cases that are bad) and the good cases' kept share."""
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for shape, label, codes, rec in all_cases:
        result = outcome(label, codes, *judged[rec["id"]])
        for key in (shape, "overall"):
            counts[key][label] += 1
            counts[key][result] += 1

    def figures(c: dict) -> dict:
        rejected = c["caught"] + c["other_code"] + c["rejected"]
        return {**{k: c[k] for k in ("bad", "caught", "other_code", "flagged", "missed", "good", "kept", "rejected")},
                "recall": c["caught"] / c["bad"] if c["bad"] else None,
                "precision": (c["caught"] + c["other_code"]) / rejected if rejected else None,
                "good_kept": c["kept"] / c["good"] if c["good"] else None}

    return {key: figures(c) for key, c in counts.items()}
