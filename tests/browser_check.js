// Opened by tests/test_docs.py in headless Chromium from the site's local web server: loads every page in a
// 1,280 px wide frame and posts back, per page, what does not fit the width and which images failed, and every
// internal link (with its #anchor) that does not lead to a page holding that anchor.
"use strict";
const WIDTH = 1280, PARALLEL = 3;
let MAX_CODE_LINE;  // from tests/test_docs.py, with the pages

// Elements of the page's content that reach past its column, or are cut off by a box that hides what
// overflows it. A box that scrolls (overflow auto/scroll) is fine: its content can be reached.
function tooWide(doc) {
  const root = doc.documentElement, style = (el) => doc.defaultView.getComputedStyle(el), out = [];
  if (root.scrollWidth > root.clientWidth + 1) out.push(`the page is ${root.scrollWidth} px wide, the viewport ${root.clientWidth}`);
  const content = doc.querySelector(".md-content") || doc.body;
  const limit = content.getBoundingClientRect().right + 1;
  const reported = [];
  for (const el of content.querySelectorAll("*")) {
    const r = el.getBoundingClientRect();
    if (!r.width || reported.some((outer) => outer.contains(el))) continue;  // the outermost one says it
    let box = el.parentElement;  // the nearest box that clips what overflows it
    while (box && box !== content && style(box).overflowX === "visible") box = box.parentElement;
    let problem = null;
    if (box && box !== content) {
      const edge = box.getBoundingClientRect().right, overflow = style(box).overflowX;
      if ((overflow === "hidden" || overflow === "clip") && r.right > edge + 1 && r.left < edge)
        problem = `is cut off at its box's right edge (${Math.round(r.right - edge)} px hidden)`;
    } else if (r.right > limit) {
      problem = `reaches ${Math.round(r.right - limit)} px past the content column`;
    }
    if (problem) {
      const name = typeof el.className === "string" ? el.className : "";
      out.push(`<${el.tagName.toLowerCase()} class="${name}"> "${(el.textContent || "").trim().slice(0, 40)}" ${problem}`);
      reported.push(el);
    }
    if (out.length >= 5) break;
  }
  return out.concat(scrolling(content, style));
}

// A box may scroll, except where it need not: a code block of lines up to MAX_CODE_LINE characters (what
// tests/test_docs.py lets a page's code blocks hold) and a table of up to four columns (its cells can wrap).
function scrolling(content, style) {
  const out = [];
  for (const code of content.querySelectorAll("pre > code")) {
    const longest = Math.max(...code.textContent.split("\n").map((line) => line.length));
    if (longest <= MAX_CODE_LINE && code.scrollWidth > code.clientWidth + 1)
      out.push(`a code block of ${longest}-character lines scrolls (${code.scrollWidth} px in ${code.clientWidth}): "${code.textContent.trim().slice(0, 40)}"`);
  }
  for (const table of content.querySelectorAll("table")) {
    const box = table.closest(".md-typeset__table") || table.parentElement;
    const columns = table.rows.length ? table.rows[0].cells.length : 0;
    if (columns <= 4 && style(box).overflowX !== "visible" && box.scrollWidth > box.clientWidth + 1)
      out.push(`a table of ${columns} columns scrolls (${box.scrollWidth} px in ${box.clientWidth}): "${table.textContent.trim().replace(/\s+/g, " ").slice(0, 40)}"`);
  }
  return out;
}

function load(frame, url) {
  return new Promise((resolve) => {
    frame.onload = () => setTimeout(resolve, 100);  // Material's scripts (diagrams, tables) run after load
    frame.src = url;
  });
}

async function checkPage(frame, url) {
  await load(frame, url);
  const doc = frame.contentDocument;
  const images = [...doc.images].filter((img) => !img.complete || !img.naturalWidth).map((img) => img.getAttribute("src"));
  const links = [...doc.querySelectorAll("a[href]")].map((a) => a.href).filter((href) => href.startsWith(location.origin));
  return {url, wide: tooWide(doc), images, links};
}

async function main() {
  const {pages, maxCodeLine} = await (await fetch("__pages__.json")).json();
  MAX_CODE_LINE = maxCodeLine;
  const results = [], queue = pages.slice();
  const workers = [...Array(PARALLEL)].map(async () => {
    const frame = document.createElement("iframe");
    frame.style.cssText = `width:${WIDTH}px;height:900px;border:0;display:block`;
    document.body.appendChild(frame);
    while (queue.length) results.push(await checkPage(frame, queue.shift()));
  });
  await Promise.all(workers);
  // Each internal link's target page is fetched once; an #anchor must be an id on it.
  const texts = new Map(), broken = [];
  for (const page of results) {
    for (const href of new Set(page.links)) {
      const [target, anchor] = href.split("#");
      if (!texts.has(target)) texts.set(target, fetch(target).then((r) => (r.ok ? r.text() : null)));
      const text = await texts.get(target);
      if (text === null) broken.push(`${page.url} -> ${href} (no such file)`);
      else if (anchor && target.endsWith(".html") && !text.includes(`id="${decodeURIComponent(anchor)}"`))
        broken.push(`${page.url} -> ${href} (no such anchor)`);
    }
    delete page.links;
  }
  await fetch("__result__", {method: "POST", body: JSON.stringify({pages: results, broken})});
}

main().catch((err) => fetch("__result__", {method: "POST", body: JSON.stringify({error: String(err.stack || err)})}));
