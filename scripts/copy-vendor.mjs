// Copies the dist files of the npm front-end libraries into static/vendor/ (git-ignored).
import { copyFileSync, mkdirSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const root = join(dirname(fileURLToPath(import.meta.url)), "..");
const files = {
  "htmx.org/dist/htmx.min.js": "htmx.min.js",
  "htmx-ext-ws/dist/ws.min.js": "htmx-ext-ws.min.js",
  "uplot/dist/uPlot.iife.min.js": "uPlot.iife.min.js",
  "uplot/dist/uPlot.min.css": "uPlot.min.css",
  // The playground renders answers as Markdown in the browser and sanitises the HTML before use.
  "markdown-it/dist/browser/markdown-it.umd.min.js": "markdown-it.min.js",
  "dompurify/dist/purify.min.js": "purify.min.js",
};
const out = join(root, "static", "vendor");
mkdirSync(out, { recursive: true });
for (const [src, dst] of Object.entries(files)) {
  copyFileSync(join(root, "node_modules", src), join(out, dst));
  console.log(`static/vendor/${dst}`);
}
