// A small Markdown renderer for model output: fenced code, headings, lists, quotes, tables, rules,
// emphasis, code spans and links. Every piece of source text is HTML-escaped before any tag is
// added, and the only tags are the ones built here, so model output never becomes markup or script.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

export function renderMarkdown(source) {
  // NUL delimits the renderer's own placeholders, so it cannot come from the source.
  const lines = source.replace(/\u0000/g, "\uFFFD").replace(/\r\n?/g, "\n").split("\n");
  return blocks(lines);
}

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?/;
const LIST_ITEM = /^( *)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_DELIMITER = /^ {0,3}\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

function blocks(lines) {
  const out = [];
  let paragraph = [];
  const flush = () => {
    if (paragraph.length) out.push(`<p>${inline(paragraph.join("\n"))}</p>`);
    paragraph = [];
  };
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if ((m = FENCE.exec(line))) {
      flush();
      const close = new RegExp(`^ {0,3}${m[1][0]}{${m[1].length},}\\s*$`);
      const body = [];
      // An unclosed fence (the answer is still streaming) runs to the end.
      for (i++; i < lines.length && !close.test(lines[i]); i++) body.push(lines[i]);
      out.push(codeBlock(body.join("\n"), m[2]));
      i++;
    } else if (!line.trim()) {
      flush();
      i++;
    } else if ((m = HEADING.exec(line))) {
      flush();
      const level = m[1].length;
      out.push(`<h${level}>${inline(m[2])}</h${level}>`);
      i++;
    } else if (RULE.test(line)) {
      flush();
      out.push("<hr>");
      i++;
    } else if (QUOTE.test(line)) {
      flush();
      const quoted = [];
      for (; i < lines.length && QUOTE.test(lines[i]); i++) quoted.push(lines[i].replace(QUOTE, ""));
      out.push(`<blockquote>${blocks(quoted)}</blockquote>`);
    } else if (LIST_ITEM.test(line) && !(paragraph.length && !/^ *(?:[-*+]|1[.)])\s/.test(line))) {
      flush();
      i = list(lines, i, out);
    } else if (line.includes("|") && i + 1 < lines.length && lines[i + 1].includes("|")
               && TABLE_DELIMITER.test(lines[i + 1])) {
      flush();
      i = table(lines, i, out);
    } else {
      paragraph.push(line);
      i++;
    }
  }
  flush();
  return out.join("");
}

function codeBlock(code, language) {
  const label = escapeHtml(language || "code");
  return `<div class="code-block"><div class="code-head"><span>${label}</span>`
    + `<button type="button" class="copy" data-copy>Copy</button></div>`
    + `<pre><code>${escapeHtml(code)}</code></pre></div>`;
}

function list(lines, i, out) {
  const first = LIST_ITEM.exec(lines[i]);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const items = [];
  while (i < lines.length) {
    const m = LIST_ITEM.exec(lines[i]);
    if (m && m[1].length === indent && /\d/.test(m[2]) === ordered) {
      items.push({ text: m[3], width: indent + m[2].length + 1, rest: [] });
      i++;
    } else if (lines[i].trim() && leading(lines[i]) > indent) {
      const item = items[items.length - 1];
      item.rest.push(lines[i].slice(Math.min(leading(lines[i]), item.width)));
      i++;
    } else if (!lines[i].trim() && i + 1 < lines.length && leading(lines[i + 1]) > indent
               && lines[i + 1].trim()) {
      i++; // a blank line inside an item
    } else if (!lines[i].trim() && i + 1 < lines.length && LIST_ITEM.test(lines[i + 1])
               && LIST_ITEM.exec(lines[i + 1])[1].length === indent) {
      i++; // a blank line between items
    } else {
      break;
    }
  }
  const start = ordered ? parseInt(first[2], 10) : 1;
  const tag = ordered ? "ol" : "ul";
  const attributes = ordered && start !== 1 ? ` start="${start}"` : "";
  const rendered = items.map((item) => `<li>${inline(item.text)}${item.rest.length ? blocks(item.rest) : ""}</li>`);
  out.push(`<${tag}${attributes}>${rendered.join("")}</${tag}>`);
  return i;
}

function leading(line) {
  return line.length - line.trimStart().length;
}

function cells(line) {
  let text = line.trim();
  if (text.startsWith("|")) text = text.slice(1);
  if (text.endsWith("|") && !text.endsWith("\\|")) text = text.slice(0, -1);
  return text.split(/(?<!\\)\|/).map((cell) => cell.trim().replace(/\\\|/g, "|"));
}

function table(lines, i, out) {
  const head = cells(lines[i]);
  const aligns = cells(lines[i + 1]).map((cell) => {
    if (cell.startsWith(":") && cell.endsWith(":")) return "center";
    if (cell.endsWith(":")) return "right";
    return cell.startsWith(":") ? "left" : "";
  });
  const rows = [];
  for (i += 2; i < lines.length && lines[i].includes("|") && lines[i].trim(); i++) rows.push(cells(lines[i]));
  const cell = (tag, text, k) => `<${tag}${aligns[k] ? ` class="align-${aligns[k]}"` : ""}>${inline(text)}</${tag}>`;
  const header = head.map((text, k) => cell("th", text, k)).join("");
  const body = rows.map((row) => `<tr>${head.map((_, k) => cell("td", row[k] ?? "", k)).join("")}</tr>`).join("");
  out.push(`<div class="table-wrap"><table><thead><tr>${header}</tr></thead><tbody>${body}</tbody></table></div>`);
  return i;
}

const SAFE_URL = /^(https?:\/\/|mailto:)/i;

function inline(text) {
  // Code spans and backslash escapes are set aside raw, out of reach of the other rules; the
  // rest is escaped, then formatted; the set-aside pieces come back last, escaped themselves.
  const slots = [];
  const keep = (html) => `\u0000${slots.push(html) - 1}\u0000`;
  let s = text.replace(/(`+)(?!`)([\s\S]*?[^`])\1(?!`)/g, (_, ticks, code) => keep(`<code>${escapeHtml(code.trim())}</code>`));
  s = s.replace(/\\([\\`*_{}[\]()#+\-.!|~>])/g, (_, c) => keep(escapeHtml(c)));
  s = escapeHtml(s);
  const link = (label, url) => {
    if (!SAFE_URL.test(url)) return label; // javascript:, data: and relative targets stay text
    return keep(`<a href="${url}" target="_blank" rel="noopener noreferrer">${label}</a>`);
  };
  // An image would be fetched from wherever the model says: it stays a link.
  s = s.replace(/!\[([^\]\n]*)\]\(([^)\s]+)\)/g, (_, alt, url) => link(`image: ${alt || url}`, url));
  s = s.replace(/\[([^\]\n]+)\]\(([^)\s]+)(?:\s+&quot;[^\n]*?&quot;)?\)/g, (_, label, url) => link(emphasis(label), url));
  s = s.replace(/(^|[\s(])(https?:\/\/[^\s\u0000]+?)(?=[.,;:!?)]*(?:\s|$|&lt;|&gt;|&quot;|&#39;|\u0000))/g,
                (_, before, url) => before + link(url, url));
  s = emphasis(s).replace(/\n/g, "<br>");
  for (let depth = 0; depth < 4 && s.includes("\u0000"); depth++) {
    s = s.replace(/\u0000(\d+)\u0000/g, (_, n) => slots[Number(n)]);
  }
  return s;
}

function emphasis(s) {
  return s
    .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
    .replace(/(?<!\w)__(?=\S)([\s\S]*?\S)__(?!\w)/g, "<strong>$1</strong>")
    .replace(/(?<![*\w])\*(?=[^\s*])([^*\n]*?[^\s*])\*(?![*\w])/g, "<em>$1</em>")
    .replace(/(?<![\w])_(?=[^\s_])([^_\n]*?[^\s_])_(?![\w])/g, "<em>$1</em>")
    .replace(/~~(?=\S)([^~\n]*?\S)~~/g, "<del>$1</del>");
}
