/* flashdraft web UI: a small Markdown renderer and a tokenizer-based syntax highlighter.
 *
 * Everything that comes from the model is escaped before any markup is added, so model output can never
 * inject HTML. Only http(s)/mailto/#fragment links are kept; images are shown as links (nothing is fetched).
 * Unclosed code fences and strings render sensibly, because answers are re-rendered while they stream.
 *
 * window.FDMarkdown = {render(markdown) -> html, highlight(code, lang) -> html, escapeHtml(text)}
 */
(function (global) {
  "use strict";

  const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const escapeHtml = (s) => String(s).replace(/[&<>"']/g, (c) => ESC[c]);
  const words = (s) => new Set(s.trim().split(/\s+/));

  /* ------------------------------------------------------------------ highlighter */

  // A language is an ordered list of [sticky regex, class] rules plus keyword sets for identifiers.
  // A class may be a function (match, src, end) -> class, for context (JSON keys, call sites).
  const IDENT = /[A-Za-z_$][\w$]*/y;
  const C_COMMENT = /\/\/.*|\/\*[\s\S]*?(?:\*\/|$)/y;
  const QUOTED = /"(?:[^"\\\n]|\\.)*"?|'(?:[^'\\\n]|\\.)*'?/y;
  const NUMBER = /(?:0[xX][\da-fA-F_]+|0[bB][01_]+|0[oO][0-7_]+|(?:\d[\d_]*\.?[\d_]*|\.\d[\d_]*)(?:[eE][+-]?\d+)?)[jJnLlUuFf]*/y;

  const LANGS = {
    python: {
      rules: [
        [/#.*/y, "com"],
        [/(?:[rRbBuUfF]{1,2})?(?:"""[\s\S]*?(?:"""|$)|'''[\s\S]*?(?:'''|$)|"(?:[^"\\\n]|\\.)*"?|'(?:[^'\\\n]|\\.)*'?)/y, "str"],
        [/@[A-Za-z_][\w.]*/y, "meta"],
        [NUMBER, "num"],
      ],
      kw: words(`and as assert async await break class continue def del elif else except finally for from global
                 if import in is lambda nonlocal not or pass raise return try while with yield match case`),
      lit: words("True False None self cls"),
      builtin: words(`print len range int float str list dict set tuple bool open enumerate zip map filter sorted
                      reversed sum min max abs isinstance type super object Exception ValueError TypeError
                      KeyError IndexError RuntimeError iter next any all repr hasattr getattr setattr`),
      defines: words("def class"),
    },
    js: {
      rules: [
        [C_COMMENT, "com"],
        [/"(?:[^"\\\n]|\\.)*"?|'(?:[^'\\\n]|\\.)*'?|`(?:[^`\\]|\\[\s\S])*`?/y, "str"],
        [NUMBER, "num"],
      ],
      kw: words(`async await break case catch class const continue debugger default delete do else export extends
                 finally for from function if import in instanceof let new of return static super switch this throw
                 try typeof var void while with yield interface type enum implements private public protected
                 readonly declare namespace as`),
      lit: words("true false null undefined NaN Infinity"),
      builtin: words(`console window document Math JSON Object Array String Number Boolean Promise Map Set Date
                      Error RegExp Symbol fetch require module exports process`),
      defines: words("function class interface type enum"),
    },
    c: {
      rules: [
        [C_COMMENT, "com"],
        [/#\s*(?:include|define|undef|ifdef|ifndef|if|elif|else|endif|pragma|error|warning)\b.*/y, "meta"],
        [/#!?\[[^\]\n]*\]?/y, "meta"],
        [/[rR]?"(?:[^"\\\n]|\\.)*"?|'(?:[^'\\\n]|\\.){1,2}'/y, "str"],
        [NUMBER, "num"],
      ],
      kw: words(`auto break case catch char class const constexpr continue default delete do double else enum
                 explicit extern float for friend goto if inline int long namespace new operator private protected
                 public register return short signed sizeof static struct switch template this throw try typedef
                 typename union unsigned using virtual void volatile while bool abstract extends final implements
                 import instanceof interface package super synchronized throws boolean byte var val fun fn let mut
                 impl trait pub mod use crate match loop move ref self Self where dyn as func go chan defer select
                 map range type struct interface package import const var override`),
      lit: words("true false null nullptr NULL nil None Some Ok Err"),
      builtin: words(`printf scanf malloc free memcpy strlen std cout cin endl vector string size_t uint8_t int32_t
                      int64_t uint32_t uint64_t float32 float64 i32 i64 u8 u32 u64 usize f32 f64 String Vec Box
                      Option Result println System out`),
      defines: words("class struct enum fn func fun interface trait impl"),
    },
    sh: {
      rules: [
        [/(?:^|(?<=[\s;&|(]))#.*/my, "com"],
        [/"(?:[^"\\]|\\[\s\S])*"?|'[^']*'?/y, "str"],
        [/\$(?:\{[^}\n]*\}?|\(\(?|[A-Za-z_]\w*|[@*#?$!0-9-])/y, "var"],
        [/(?<=\s)--?[A-Za-z][\w-]*/y, "meta"],
        [/\d+(?:\.\d+)?(?![\w.])/y, "num"],
        [/[A-Za-z_][\w.-]*/y, null], // words: keyword check below; dashes are part of command names
      ],
      kw: words(`if then else elif fi for while until do done case esac in function return local export
                 readonly declare unset shift break continue exit set source alias`),
      lit: words("true false"),
      builtin: words(`echo cd ls cat grep sed awk find mkdir rm cp mv chmod chown curl wget pip python python3
                      git sudo apt apt-get docker make npm node kill ps tar ssh printf test read eval exec which
                      flashdraft uv`),
      defines: words("function"),
    },
    json: {
      rules: [
        [/"(?:[^"\\\n]|\\.)*"?/y, (m, src, end) => (/^\s*:/.test(src.slice(end, end + 64)) ? "key" : "str")],
        [/-?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?/y, "num"],
        [/\/\/.*/y, "com"],
      ],
      kw: new Set(),
      lit: words("true false null"),
      builtin: new Set(),
      defines: new Set(),
    },
  };

  const ALIASES = {};
  const alias = (lang, names) => words(names).forEach((n) => (ALIASES[n] = lang));
  alias("python", "python py python3 py3 python2 gyp ipython pycon");
  alias("js", "js javascript jsx mjs cjs node ts typescript tsx");
  alias("c", `c h cpp c++ cc cxx hpp hh cu cuda java rust rs go golang cs csharp kotlin kt swift scala zig
              objc objective-c dart glsl hlsl metal proto`);
  alias("sh", "sh bash shell zsh ksh fish console shellsession terminal powershell ps1 bat cmd dockerfile");
  alias("json", "json jsonc json5 jsonl geojson");

  function guessLang(code) {
    const t = code.trim();
    if (/^[[{]/.test(t)) {
      try { JSON.parse(t); return "json"; } catch (e) { /* not JSON */ }
    }
    if (/^\s*(?:def |class \w+.*:\s*$|import \w+|from [\w.]+ import |if __name__)/m.test(code)) return "python";
    if (/^\s*(?:\$ |#!\/\S*sh|sudo |apt(?:-get)? |pip3? |cd |export |curl )/m.test(code)) return "sh";
    if (/#include|\bint main\s*\(|public static|\bfn main\s*\(|std::|func main\s*\(/.test(code)) return "c";
    if (/\b(?:function|const|let|var)\s+\w+|=>|console\.log/.test(code)) return "js";
    return null;
  }

  function highlight(code, lang) {
    const name = ALIASES[String(lang || "").toLowerCase()] || (lang ? null : guessLang(code));
    const L = name && LANGS[name];
    if (!L) return escapeHtml(code);
    let out = "";
    let plain = "";
    let pos = 0;
    let defining = false; // previous keyword was def/class/function: the next identifier is a name being defined
    const flush = () => { if (plain) { out += escapeHtml(plain); plain = ""; } };
    const emit = (text, cls) => {
      if (!cls) { plain += text; return; }
      flush();
      out += `<span class="tok-${cls}">${escapeHtml(text)}</span>`;
    };
    const identRule = [name === "sh" ? null : IDENT, null];
    const rules = identRule[0] ? L.rules.concat([identRule]) : L.rules;
    while (pos < code.length) {
      let matched = false;
      for (const [re, cls] of rules) {
        re.lastIndex = pos;
        const m = re.exec(code);
        if (!m || m[0].length === 0) continue;
        const end = pos + m[0].length;
        let c = typeof cls === "function" ? cls(m[0], code, end) : cls;
        if (cls === null) { // identifier
          const w = m[0];
          if (L.kw.has(w)) c = "kw";
          else if (L.lit.has(w)) c = "lit";
          else if (defining) c = "fn";
          else if (L.builtin.has(w)) c = "bi";
          else if (name !== "sh" && /^\s*\(/.test(code.slice(end, end + 8))) c = "fn";
          defining = L.defines.has(w);
        } else if (c !== "com") {
          defining = false;
        }
        emit(m[0], c);
        pos = end;
        matched = true;
        break;
      }
      if (!matched) {
        const ch = code[pos];
        if (!/\s/.test(ch)) defining = defining && /[\s*&]/.test(ch);
        plain += ch;
        pos += 1;
      }
    }
    flush();
    return out;
  }

  /* ------------------------------------------------------------------ inline Markdown */

  const safeUrl = (url) => /^(?:https?:\/\/|mailto:|#)/i.test(url);

  function inline(text) {
    const stash = [];
    const hold = (html) => "\u0000" + (stash.push(html) - 1) + "\u0000";
    let s = text;
    // code spans first: nothing inside them is Markdown
    s = s.replace(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g,
      (m, ticks, code) => hold(`<code>${escapeHtml(code.replace(/^ ([\s\S]*) $/, "$1"))}</code>`));
    // backslash escapes
    s = s.replace(/\\([\\`*_{}[\]()#+\-.!~|<>])/g, (m, c) => hold(escapeHtml(c)));
    s = escapeHtml(s);
    // images become links (never fetched), then links; the label keeps emphasis
    s = s.replace(/!?\[([^\]\n]+)\]\(\s*([^()\s]+)(?:\s+&quot;[^\n]*?&quot;)?\s*\)/g, (m, label, url) =>
      safeUrl(url) ? hold(`<a href="${url}" target="_blank" rel="noopener noreferrer">${emphasis(label)}</a>`) : m);
    s = s.replace(/&lt;((?:https?:\/\/|mailto:)[^\s&]+)&gt;/g,
      (m, url) => hold(`<a href="${url}" target="_blank" rel="noopener noreferrer">${url}</a>`));
    s = s.replace(/\bhttps?:\/\/(?:(?!&quot;|&#39;|&lt;|&gt;)[^\s\u0000])*(?:(?!&quot;|&#39;|&lt;|&gt;)[^\s\u0000.,:;!?)\]'])/g,
      (url) => hold(`<a href="${url}" target="_blank" rel="noopener noreferrer">${url}</a>`));
    s = emphasis(s);
    s = s.replace(/(?: {2,}|\\)\n/g, "<br>").replace(/\n/g, "<br>");
    return s.replace(/\u0000(\d+)\u0000/g, (m, i) => stash[+i]);
  }

  function emphasis(s) {
    return s
      .replace(/\*\*\*(?=\S)([\s\S]*?\S)\*\*\*/g, "<strong><em>$1</em></strong>")
      .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
      .replace(/(^|[^*\w])\*(?=[^\s*])([^*\n]*?[^\s*])\*(?!\*)/g, "$1<em>$2</em>")
      .replace(/(^|[^*\w])\*([^\s*])\*(?!\*)/g, "$1<em>$2</em>")
      .replace(/(^|[^\w])_(?=[^\s_])([^_\n]*?[^\s_]|[^\s_])_(?!\w)/g, "$1<em>$2</em>")
      .replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
  }

  /* ------------------------------------------------------------------ block Markdown */

  const FENCE = /^( {0,3})(`{3,}|~{3,})\s*([^\s`]*)[^`]*$/;
  const HEADING = /^ {0,3}(#{1,6})(?:\s+(.*?))?(?:\s+#+)?\s*$/;
  const HR = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
  const QUOTE = /^ {0,3}> ?(.*)$/;
  const LIST = /^( *)([-*+]|\d{1,9}[.)])(?:( +)(.*)|)$/;
  const TABLE_SEP = /^\s*\|?\s*:?-+:?\s*(?:\|\s*:?-+:?\s*)*\|?\s*$/;

  const startsBlock = (line) => FENCE.test(line) || HEADING.test(line) || HR.test(line) || QUOTE.test(line) ||
    LIST.test(line);

  function codeBlock(code, lang) {
    const label = lang ? escapeHtml(lang) : "code";
    return `<div class="codeblock"><div class="codebar"><span class="codelang">${label}</span>` +
      `<button type="button" class="copy-btn" data-copy="code" title="Copy code">Copy</button></div>` +
      `<pre><code>${highlight(code, lang)}</code></pre></div>`;
  }

  function splitRow(line) {
    const cells = [];
    let cur = "";
    let inCode = false;
    const t = line.trim().replace(/^\|/, "").replace(/\|$/, "");
    for (let i = 0; i < t.length; i++) {
      const ch = t[i];
      if (ch === "\\" && t[i + 1] === "|") { cur += "|"; i++; continue; }
      if (ch === "`") inCode = !inCode;
      if (ch === "|" && !inCode) { cells.push(cur.trim()); cur = ""; continue; }
      cur += ch;
    }
    cells.push(cur.trim());
    return cells;
  }

  function table(lines) {
    const head = splitRow(lines[0]);
    const align = splitRow(lines[1]).map((c) =>
      /^:-+:$/.test(c) ? "center" : /-:$/.test(c) ? "right" : /^:-/.test(c) ? "left" : "");
    const cell = (tag, text, i) =>
      `<${tag}${align[i] ? ` style="text-align:${align[i]}"` : ""}>${inline(text || "")}</${tag}>`;
    let html = "<div class=\"tablewrap\"><table><thead><tr>" + head.map((c, i) => cell("th", c, i)).join("") +
      "</tr></thead><tbody>";
    for (const row of lines.slice(2)) {
      const cells = splitRow(row);
      html += "<tr>" + head.map((_, i) => cell("td", cells[i], i)).join("") + "</tr>";
    }
    return html + "</tbody></table></div>";
  }

  function list(lines, i) {
    const first = LIST.exec(lines[i]);
    const ordered = /\d/.test(first[2]);
    const base = first[1].length;
    const items = [];
    let cur = null;
    let contentIndent = 0;
    let blank = false;
    let loose = false;
    for (; i < lines.length; i++) {
      const line = lines[i];
      if (!line.trim()) { blank = true; if (cur) cur.push(""); continue; }
      const indent = line.match(/^ */)[0].length;
      const m = LIST.exec(line);
      if (m && (cur === null || indent <= base + 1)) {
        if (/\d/.test(m[2]) !== ordered) break; // a different kind of list starts
        if (blank && cur) loose = true;
        blank = false;
        const gap = m[3] ? m[3].length : 1;
        contentIndent = indent + m[2].length + (gap > 4 ? 1 : gap);
        cur = [m[3] && gap > 4 ? " ".repeat(gap - 1) + m[4] : m[4] || ""];
        items.push({ lines: cur, start: ordered ? parseInt(m[2], 10) : null });
        continue;
      }
      if (indent >= Math.min(contentIndent, base + 2) || (!blank && !startsBlock(line))) {
        if (blank) loose = true;
        blank = false;
        cur.push(line.slice(Math.min(indent, contentIndent)));
        continue;
      }
      break;
    }
    while (cur && cur.length && cur[cur.length - 1] === "") cur.pop();
    const start = ordered && items[0].start !== 1 ? ` start="${items[0].start}"` : "";
    let html = ordered ? `<ol${start}>` : "<ul>";
    for (const item of items) {
      let body = item.lines;
      let box = "";
      const task = /^\[([ xX])\]\s+/.exec(body[0]);
      if (task) {
        box = `<input type="checkbox" disabled${task[1] === " " ? "" : " checked"}> `;
        body = [body[0].slice(task[0].length)].concat(body.slice(1));
      }
      html += `<li${task ? " class=\"task\"" : ""}>${box}${blocks(body, !loose)}</li>`;
    }
    return [html + (ordered ? "</ol>" : "</ul>"), i];
  }

  function blocks(lines, tight) {
    const out = [];
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (!line.trim()) { i++; continue; }
      if ((m = FENCE.exec(line))) {
        const [, pad, fence, lang] = m;
        const close = new RegExp(`^ {0,3}${fence[0] === "`" ? "`" : "~"}{${fence.length},}\\s*$`);
        const body = [];
        for (i++; i < lines.length && !close.test(lines[i]); i++) {
          body.push(lines[i].replace(new RegExp(`^ {0,${pad.length}}`), ""));
        }
        i++; // the closing fence (or past the end while the answer is still streaming)
        out.push(codeBlock(body.join("\n"), lang));
        continue;
      }
      if ((m = HEADING.exec(line))) {
        const n = m[1].length;
        out.push(`<h${n}>${inline(m[2] || "")}</h${n}>`);
        i++;
        continue;
      }
      if (HR.test(line)) { out.push("<hr>"); i++; continue; }
      if (QUOTE.test(line)) {
        const body = [];
        for (; i < lines.length && lines[i].trim() && (m = QUOTE.exec(lines[i]) || [null, lines[i]]); i++) {
          body.push(m[1]);
        }
        out.push(`<blockquote>${blocks(body, false)}</blockquote>`);
        continue;
      }
      if ((m = LIST.exec(line)) && (m[4] || "").trim()) {
        const [html, next] = list(lines, i);
        out.push(html);
        i = next;
        continue;
      }
      if (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1]) && lines[i + 1].includes("-")) {
        const rows = [line, lines[i + 1]];
        for (i += 2; i < lines.length && lines[i].trim() && lines[i].includes("|"); i++) rows.push(lines[i]);
        out.push(table(rows));
        continue;
      }
      const para = [line];
      for (i++; i < lines.length && lines[i].trim() && !startsBlock(lines[i]); i++) para.push(lines[i]);
      const html = inline(para.map((l) => l.replace(/^\s+/, "")).join("\n"));
      out.push(tight ? html : `<p>${html}</p>`);
    }
    return tight ? out.join("\n") : out.join("");
  }

  function render(markdown) {
    const src = String(markdown == null ? "" : markdown).replace(/\r\n?/g, "\n").replace(/\u0000/g, "\uFFFD");
    return blocks(src.split("\n"), false);
  }

  global.FDMarkdown = { render, highlight, escapeHtml };
})(window);
